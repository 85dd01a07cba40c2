"""The main module of the input pipeline's worker processes (``processes.spawn_workers_light``).

Grain starts its workers with multiprocessing's "spawn" method, whose children import the parent's
``__main__`` first. Named here instead of the entry point, a worker imports the data layer alone, not
the model, optimizer and trainer an entry point pulls in. It defines nothing: what a worker runs comes
pickled from the training process.
"""
