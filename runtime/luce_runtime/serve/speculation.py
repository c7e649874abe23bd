"""Speculative decoding in the server: which requests speculate, their drafters, and one step's drafts.

    spec = Speculation.ngram(target, draft_max=8)   # or Speculation.draft_model(draft_engine, target, 8)
    Scheduler(engine, max_batch, speculation=spec)

Each speculating request owns a drafter (prompt lookup, or its own sequence in the one shared draft engine) and an
adaptive draft length. Per step the scheduler asks `drafts` for every ready request's proposal, verifies all of them
in one Engine.verify call (the plain ones decode in the batched call as before), and commits each request's tokens
position by position with speculative.judge: a grammar's mask is applied to every verified row before judging, and
the constraint consumes only accepted tokens, so a constrained request speculates too and never needs rolling back.

Opt-out: a request body's `"speculative": false` (a luce extension; the OpenAI client sends it through extra_body).
A drafter that fails turns speculation off for that request alone; it goes on decoding plainly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from luce_runtime.engine import Engine
from luce_runtime.speculative import (
    Draft,
    Drafter,
    DraftLength,
    DraftModel,
    NgramDrafter,
    check_same_vocabulary,
    refuse_sliding_window,
)

if TYPE_CHECKING:
    from luce_runtime.serve.scheduler import GenRequest

log = logging.getLogger(__name__)


@dataclass
class RequestSpec:
    """One request's speculation state: its drafter and the draft length its own acceptance history chose."""

    drafter: Drafter
    length: DraftLength


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
        refuse_sliding_window(draft, "draft model")
        check_same_vocabulary(target, draft)
        DraftLength(draft_max)
        return cls("draft", lambda: DraftModel(draft, target, checked=True), draft_max, draft)

    def start(self) -> RequestSpec:
        return RequestSpec(self.make_drafter(), DraftLength(self.draft_max))


def drafts(ready: Sequence[GenRequest], budget: int) -> dict[GenRequest, Draft]:
    """The non-empty drafts of the speculating requests in `ready`, within `budget` tokens fed to one verify
    (each request feeds its pending token and its drafts). A request whose drafter fails stops speculating."""
    out: dict[GenRequest, Draft] = {}
    for r in ready:
        if r.spec is None:
            continue
        # a step commits up to k + 1 tokens: never more than max_tokens allows (the cache then stays in context)
        k = min(r.spec.length.k, r.params.max_tokens - len(r.generated) - 1, budget - 1)
        if k < 1:
            continue
        try:
            draft = r.spec.drafter.propose([*r.prompt, *r.generated], k, r.sampler)
        except Exception:
            log.exception("serve: the %s drafter failed; this request goes on without speculation",
                          type(r.spec.drafter).__name__)
            stop(r)
            continue
        if draft.tokens:
            out[r] = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k])
            budget -= len(out[r].tokens) + 1
    return out


def stop(r: GenRequest) -> None:
    """End r's speculation and free its drafter's state (the draft engine's sequence)."""
    if r.spec is None:
        return
    try:
        r.spec.drafter.reset()
    except Exception:
        log.exception("serve: freeing a drafter's state failed")
    r.spec = None
