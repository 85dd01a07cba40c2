"""MQAR, zoology's multi-query associative recall benchmark (MATH §6.5).

``data`` generates the task, ``config`` holds the typed recipe, ``train`` trains and evaluates the
2-layer zoology model, ``sweep`` runs the resumable mixer × width × learning-rate grid and ``report``
turns its JSONL into a table and an accuracy-vs-state-bytes plot.
"""
