"""Per-SM task queues for the megakernel, planned on the host by list scheduling with a cost model.

Every block of the persistent kernel walks its own queue; before a task it waits for the counters of the tasks it
depends on, after it bumps its own. Each queue is in increasing task id, and task ids are a topological order of
the dependencies (fuse/taskgraph.py), so with every block resident the lowest unfinished task can always run:
no deadlock, and no scheduler blocks (MPK's scheduler warps cost SMs and deadlocked; notes/megakernel.md).

The cost model is the bytes a task streams at the SM's share of the memory bandwidth plus a fixed cost per task
(a dependency wait and the block's barriers, ~0.6 us on the H200: notes/megakernel.md). It only orders and places
work; measured per-task times replace it once the kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from luce_compile.fuse.taskgraph import Task, TaskGraph, TaskKind


@dataclass(frozen=True)
class CostModel:
    bandwidth: float = 4.0e12  # bytes/s over the whole GPU (an H200 streams ~4 TB/s in a GEMV at best)
    n_sms: int = 132
    task_overhead: float = 0.6e-6  # s: the dependency wait and barriers around one task

    def seconds(self, task: Task) -> float:
        return self.task_overhead + task.weight_bytes / (self.bandwidth / self.n_sms)


@dataclass(frozen=True)
class Plan:
    queues: tuple[tuple[int, ...], ...]  # per SM: task ids in the order that SM runs them
    makespan: float  # the cost model's estimate of one step, seconds
    critical_path: float  # the longest dependency chain's cost, seconds: no placement can beat it

    def check(self, tg: TaskGraph) -> None:
        """Every task on exactly one queue, each queue in increasing id (what makes the kernel deadlock-free)."""
        placed = sorted(t for q in self.queues for t in q)
        if placed != list(range(len(tg.tasks))):
            raise AssertionError("plan: tasks missing from or repeated on the queues")
        if any(list(q) != sorted(q) for q in self.queues):
            raise AssertionError("plan: a queue is not in task order")


def plan_queues(tg: TaskGraph, cost: CostModel) -> Plan:
    """Place tasks in id order on the SM where each can start first (earliest finish on ties), but for the
    attention chunks that hold no keys at the cost model's context (KV_PLAN_CONTEXT): those take the SMs in turn.
    Placed by cost they cost only the task overhead, so the few SMs idle at that point took dozens each (the 8B's
    b=8 kernel built for 32K: 34 chunks of 2,048 keys on 4 SMs, 6-7 on the others): at a longer context, where they
    hold keys, the attention stage lasted 34 chunks instead of 8. In turn, and in id order (split-major), any
    prefix of the splits is spread evenly, whatever the context a step has."""
    free = [0.0] * cost.n_sms  # when each SM is next idle
    finish: list[float] = []
    chain: list[float] = []  # longest dependency chain ending at each task
    queues: list[list[int]] = [[] for _ in range(cost.n_sms)]
    in_turn = 0  # the chunks placed in turn so far
    for task in tg.tasks:
        ready = max((finish[d] for d in task.deps), default=0.0)
        if task.kind == TaskKind.ATTN_PARTIAL and task.weight_bytes == 0:
            sm, in_turn = in_turn % cost.n_sms, in_turn + 1
        else:
            sm = min(range(cost.n_sms), key=lambda s: (max(free[s], ready), free[s]))
        took = cost.seconds(task)
        finish.append(max(free[sm], ready) + took)
        free[sm] = finish[-1]
        queues[sm].append(task.id)
        chain.append(max((chain[d] for d in task.deps), default=0.0) + took)
    return Plan(tuple(tuple(q) for q in queues), max(finish, default=0.0), max(chain, default=0.0))
