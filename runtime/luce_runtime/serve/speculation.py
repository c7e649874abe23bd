"""Speculative decoding in the server: which requests speculate, and their drafters.

    spec = Speculation.ngram(target, draft_max=8)   # or Speculation.draft_model(draft_engine, target, 8)
    Scheduler(engine, max_batch, speculation=spec)

Each speculating request owns a drafter (prompt lookup, or its own sequence in the one shared draft engine) and an
adaptive draft length. The drafting, the verify of every drafting request in one Engine.verify call and the commit
are the generation loop's (luce_runtime.generation, the same loop `run` and `bench` use): a grammar's mask is
applied to every verified row before judging, and the constraint consumes only accepted tokens, so a constrained
request speculates too and never needs rolling back.

Opt-out: a request body's `"speculative": false` (a luce extension; the OpenAI client sends it through extra_body).
A drafter that fails turns speculation off for that request alone; it goes on decoding plainly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from luce_runtime.engine import Engine
from luce_runtime.generation import Speculating
from luce_runtime.speculative import (
    Drafter,
    DraftLength,
    DraftModel,
    NgramDrafter,
    check_same_vocabulary,
    refuse_sliding_window,
)


@dataclass
class Speculation:
    """How the server speculates: a drafter per request (from `make_drafter`), at most draft_max tokens a step."""

    name: str  # "ngram" | "draft"
    make_drafter: Callable[[], Drafter]
    draft_max: int = 8
    draft_engine: Engine | None = field(default=None, repr=False)

    @classmethod
    def ngram(cls, target: Engine, draft_max: int) -> Speculation:
        refuse_sliding_window(target, "target model")
        DraftLength(draft_max)  # refuses draft_max < 1 now, not at the first request
        return cls("ngram", NgramDrafter, draft_max)

    @classmethod
    def draft_model(cls, draft: Engine, target: Engine, draft_max: int) -> Speculation:
        """Draft with `draft` (loaded with a sequence per batch slot): its vocabulary is checked once here."""
        refuse_sliding_window(target, "target model")
        check_same_vocabulary(target, draft)
        DraftLength(draft_max)
        return cls("draft", lambda: DraftModel(draft, target, checked=True), draft_max, draft)

    def start(self) -> Speculating:
        """A request's drafter and draft length; the length from its acceptance alone (a batched step's time is
        no one request's cost)."""
        return Speculating(self.make_drafter(), DraftLength(self.draft_max), timed=False)
