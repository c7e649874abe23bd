"""luce_runtime.timing, the one timing method, and the two harnesses that time an engine through it (bench_engine,
scripts/device_check.py). Fake clocks and a fake engine: the tests check what is inside each timed interval (the
device synchronized on both sides, warm-ups and prompt drawing outside), never a duration."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from luce_runtime.bench import bench_engine
from luce_runtime.timing import call_times, median_time

from tests.bench._load import load_script

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """Each fn() call advances time by the next duration; the clock reads the current time."""

    def __init__(self, durations: list[float]):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += self.durations.pop(0)


@pytest.mark.unit
def test_median_time_skips_warmup_and_takes_median():
    # the warm-up calls (100 s each) must not be timed; the timed ones are 3, 1, 2, 50, 4 → median 3
    clock = FakeClock([100.0, 100.0, 3.0, 1.0, 2.0, 50.0, 4.0])
    assert median_time(clock.work, repeat=5, warmup=2, clock=clock) == pytest.approx(3.0)
    assert clock.calls == 7


@pytest.mark.unit
def test_median_time_even_repeat_and_no_warmup():
    clock = FakeClock([1.0, 2.0, 10.0, 20.0])
    assert median_time(clock.work, repeat=4, warmup=0, clock=clock) == pytest.approx(6.0)
    assert clock.calls == 4


@pytest.mark.unit
@pytest.mark.parametrize(("repeat", "warmup", "message"), [(0, 1, "repeat must be positive"),
                                                           (1, -1, "warmup must be 0 or more")])
def test_call_times_rejects_bad_counts(repeat: int, warmup: int, message: str):
    with pytest.raises(ValueError, match=message):
        call_times(lambda: None, repeat=repeat, warmup=warmup)


@pytest.mark.unit
def test_device_work_queued_by_the_call_is_inside_the_interval():
    """A GPU call returns before its work is done; the sync after it waits for that work. Modelled: each call queues
    2 s of device work, the sync runs it. Without the closing sync a sample would read 0."""
    clock, queued = FakeClock([]), []
    events: list[str] = []

    def launch() -> None:
        events.append("call")
        queued.append(2.0)

    def sync() -> None:
        events.append("sync")
        clock.now += sum(queued)
        queued.clear()

    assert call_times(launch, repeat=3, warmup=1, sync=sync, clock=clock) == [2.0, 2.0, 2.0]
    # the warm-up's work is synchronized before the first clock read, so it is not charged to the first sample
    assert events == ["call"] + ["sync", "call", "sync"] * 3


class FakeEngine:
    """The Engine surface bench_engine uses; records the order of calls and syncs."""

    def __init__(self, vocab: int = 50):
        self.config = {"n_vocab": vocab}
        self.options = SimpleNamespace(prefill_chunk=512)
        self.device = SimpleNamespace(sync=lambda: self.events.append("sync"))
        self.events: list[str] = []
        self.live: set[int] = set()
        self.next_id = 0

    def add_sequence(self) -> int:
        self.next_id += 1
        self.live.add(self.next_id)
        return self.next_id

    def remove_sequence(self, seq: int) -> None:
        self.live.remove(seq)

    def prefill(self, seqs: list[int], prompts: list[list[int]]) -> np.ndarray:
        self.events.append(f"prefill{len(prompts[0])}")
        return np.zeros((len(seqs), self.config["n_vocab"]), np.float32)

    def decode(self, seqs: list[int], tokens: list[int]) -> np.ndarray:
        self.events.append(f"decode{len(seqs)}")
        return np.zeros((len(seqs), self.config["n_vocab"]), np.float32)

    def decode_greedy(self, seqs: list[int], tokens: list[int]) -> list[int]:
        return np.argmax(self.decode(seqs, tokens), axis=-1).tolist()


@pytest.mark.unit
def test_bench_engine_synchronizes_every_timed_call_and_frees_its_sequences():
    engine = FakeEngine()
    out = bench_engine(engine, prompt_len=8, gen_len=5, batch=3, repeat=2, prefill_lens=(16,))
    assert set(out) == {"prefill_tok_s", "ttft_ms", "decode_tok_s", "decode_batch_tok_s", "prefill_by_len"}
    assert not engine.live
    ev = engine.events
    timed = [i for i, e in enumerate(ev) if e != "sync"]
    # 1 warm-up + 2 timed TTFT prefills, 2 at length 16, then per batch size a prompt prefill, 1 warm-up step and 5
    assert [ev[i] for i in timed] == (["prefill8"] * 3 + ["prefill16"] * 2 + ["prefill8"] + ["decode1"] * 6
                                      + ["prefill8"] + ["decode3"] * 6)
    synced = [ev[i] for i in timed if 0 < i < len(ev) - 1 and ev[i - 1] == ev[i + 1] == "sync"]
    assert synced == ["prefill8"] * 2 + ["prefill16"] * 2 + ["decode1"] * 5 + ["decode3"] * 5


def _device_check():
    return load_script("device_check")


@pytest.mark.unit
def test_device_check_times_through_bench_engine_in_its_record_schema():
    """device_check's timing section keeps the committed records' fields, filled by bench_engine's numbers."""
    record = json.loads((ROOT / "benchmarks" / "results" / "h200" / "2026-11-30-smollm2.json").read_text())
    engine = FakeEngine()
    timing = _device_check().time_engine(engine, prompt_len=8, prefill_lens=(16,), steps=4)
    assert set(timing) == set(record["timing"])
    assert set(timing["decode"]) == set(record["timing"]["decode"])
    assert [set(p) for p in timing["prefill"]] == [set(p) for p in record["timing"]["prefill"]]
    assert [p["tokens"] for p in timing["prefill"]] == [8, 16]
    for p in timing["prefill"]:
        assert p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"])
    assert timing["decode"]["ms_per_token"] == pytest.approx(1e3 / timing["decode"]["tok_s"])
    assert engine.events.count("decode1") == 5  # one warm-up step and `steps` timed ones: bench_engine's count
