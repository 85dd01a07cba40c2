"""The phase clock partitions a run's wall time; its record and line say where the time went."""


import pytest

from lmcore.train import goodput, metrics


class FakeClock:
  """A clock that advances by the seconds given to ``tick``."""

  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now

  def tick(self, seconds: float) -> None:
    self.now += seconds


def test_phases_partition_the_wall_time_and_parts_add_to_their_phase():
  time = FakeClock()
  clock = goodput.PhaseClock(before_s=2.0, clock=time)
  time.tick(1.0)  # start-up, outside any part
  with clock.phase("startup/model"):
    time.tick(3.0)
  with clock.phase("compile"):
    time.tick(4.0)
  clock.switch("steps")
  time.tick(10.0)
  with clock.phase("eval/heldout"):
    time.tick(0.5)
  with clock.phase("eval/unigram"):
    time.tick(0.25)
  with clock.phase("data_wait"):
    time.tick(0.75)
  time.tick(2.0)
  clock.switch("shutdown")
  time.tick(1.5)
  record = clock.record()
  assert record["wall_s"] == pytest.approx(25.0)
  assert record["phases"] == pytest.approx({"startup": 6.0, "compile": 4.0, "steps": 12.0, "data_wait": 0.75,
                                            "checkpoint": 0.0, "eval": 0.75, "shutdown": 1.5})
  assert sum(record["phases"].values()) == pytest.approx(record["wall_s"])
  assert record["parts"] == {"startup": {"imports": 2.0, "model": 3.0}, "eval": {"heldout": 0.5, "unigram": 0.25}}
  assert record["goodput"] == pytest.approx(12.0 / 25.0)
  assert goodput.summary_line(record) == (
      "wall 25.0 s: steps 12.0 s (48 %), startup 6.0 s (imports 2.0, model 3.0), compile 4.0 s, "
      "data wait 0.8 s, checkpoint 0.0 s, eval 0.8 s (heldout 0.5, unigram 0.2), shutdown 1.5 s")


def test_a_phase_left_by_an_exception_returns_to_the_enclosing_one():
  time = FakeClock()
  clock = goodput.PhaseClock(clock=time)
  clock.switch("steps")
  with pytest.raises(RuntimeError), clock.phase("checkpoint"):
    time.tick(1.0)
    raise RuntimeError
  assert clock.current == "steps"


def test_an_unknown_phase_is_reported_as_other():
  time = FakeClock()
  clock = goodput.PhaseClock(clock=time)
  with clock.phase("mystery"):
    time.tick(2.0)
  record = clock.record()
  assert record["phases"]["other"] == pytest.approx(2.0) and record["parts"] == {"other": {"mystery": 2.0}}
  assert "other 2.0 s" in goodput.summary_line(record)


def test_only_an_entry_point_charges_the_process_start_and_only_to_its_first_run(monkeypatch):
  monkeypatch.setattr(goodput, "_process_start_pending", False)
  assert goodput.take_process_start() == 0.0  # a library caller (this test process)
  goodput.count_process_start()
  assert goodput.take_process_start() > 0.0
  assert goodput.take_process_start() == 0.0


def test_throughput_counts_step_time_only_and_the_eta_counts_everything():
  time = FakeClock()
  clock = goodput.PhaseClock(clock=time)
  clock.switch("steps")
  throughput = metrics.Throughput(0, None, clock)
  time.tick(8.0)  # 10 steps of 0.8 s
  with clock.phase("eval/heldout"):
    time.tick(2.0)
  interval = throughput.update(10, tokens_per_step=1000)
  assert (interval.step_s, interval.tokens_per_s, interval.wall_per_step_s) == pytest.approx((0.8, 1250.0, 1.0))
  assert interval.goodput == pytest.approx(0.8)
  line = metrics.progress_line(10, 20, 2.5, interval)
  assert line == "step 10/20 | loss 2.5000 | 1,250 tok/s | 800.0 ms/step | goodput 80% | ETA 0:00:10"


class Output:
  """An array a dispatched computation writes: ready or not."""

  def __init__(self, ready: bool):
    self.ready = ready

  def is_ready(self) -> bool:
    return self.ready


@pytest.mark.parametrize("device_busy", [True, False])
def test_a_batch_fetched_while_the_step_runs_counts_as_step_time(device_busy):
  time = FakeClock()
  clock = goodput.PhaseClock(clock=time)
  clock.switch("steps")
  throughput = metrics.Throughput(0, None, clock)
  time.tick(3.0)

  def fetch():
    time.tick(1.0)
    return "batch"

  assert goodput.fetch_beside(clock, fetch, running=[Output(True), Output(not device_busy)]) == "batch"
  assert clock.current == "steps"
  record = clock.record()
  assert record["phases"]["steps"] == pytest.approx(4.0 if device_busy else 3.0)
  assert record["phases"]["data_wait"] == pytest.approx(0.0 if device_busy else 1.0)
  assert record["parts"].get("steps") == ({"data_overlapped": 1.0} if device_busy else None)
  assert clock.goodput() == pytest.approx(1.0 if device_busy else 0.75)
  assert throughput.update(1, tokens_per_step=1).step_s == pytest.approx(4.0 if device_busy else 3.0)
  if device_busy:
    assert goodput.summary_line(record).startswith("wall 4.0 s: steps 4.0 s (100 %; data overlapped 1.0), ")
