"""One adapter protocol for every engine a lab runs, so one runner drives them all.

An adapter takes requests (`add(idx, arrival)`), says whether work is left (`has_work()`), runs one
iteration (`step()`, returning an `Event` per token produced or request finished), reports its
counters (`counters()`: preemptions, prefix-cache hit rate, model tokens run, ... where it has them)
and releases what it holds (`close()`).

- `MlxLm`: mlx-lm's `BatchGenerator` (the peer), on mlx-lm's own model.
- `Day27`: day 2.7's `batch.SlotScheduler` of a selection (student or reference), on its week-2 model.
- `Week3`: week 3's `LLMEngine` of a selection, with any `EngineConfig` (budget policy, order, ...; `course.engines.PLAIN_ENGINE`:
  the engine with only what a lab switches on).
- `Speculative`: day 4.1's `SpeculativeEngine` of a selection (a `Week3` with guesses and their counters).
- `TensorParallel`: day 4.4's `TensorParallelEngine` of a selection on rank 0 (the other ranks follow it).

Their engines are built by `course.engines` (`week3_engine`, `speculative_engine`), the one place a lab
or `compare` builds one.
"""

from __future__ import annotations

from typing import NamedTuple

from benches.workloads import Arrival
from course.engines import speculative_engine, week3_engine



class Event(NamedTuple):
    idx: int  # the arrival's index in its workload
    token: int | None  # a token it produced (None: it finished without one, e.g. at EOS)
    finished: bool


class Adapter:
    """What the runner needs of an engine; `counters` and `close` may stay as they are."""

    def add(self, idx: int, arrival: Arrival) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> list[Event]:
        raise NotImplementedError

    def counters(self) -> dict:
        """Engine-side figures of the run so far (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the engine holds (nothing by default)."""


# ---------------------------------------------------------------- week 3


class Week3(Adapter):
    """Week 3's `LLMEngine`; `config` are `EngineConfig` fields (token_budget, budget_policy, ...)."""

    def __init__(self, selection, model, tokenizer, **config):
        self.engine = week3_engine(selection, model, tokenizer, **config)
        self.sampling = selection.sequence.SamplingParams

    def add(self, idx, arrival):
        self.engine.add_request(arrival.prompt, self.sampling(max_tokens=arrival.max_tokens), request_id=idx,
                                priority=arrival.priority)

    def has_work(self):
        return self.engine.has_work()

    def step(self):
        return [Event(o.request_id, o.token, o.finished) for o in self.engine.step()]

    def counters(self):
        engine = self.engine
        return {"num_preemptions": engine.num_preemptions, "prefix_cache_hit_rate": engine.prefix_cache_hit_rate,
                "tokens_run": engine.prompt_tokens_total + engine.generation_tokens_total}


class Speculative(Week3):
    """Day 4.1's `SpeculativeEngine`; its counters add the guesses proposed and accepted."""

    def __init__(self, selection, model, tokenizer, proposer=None, num_speculative_tokens: int = 4,
                 adaptive: bool = True, **config):
        self.engine = speculative_engine(selection, model, tokenizer, proposer, num_speculative_tokens,
                                         adaptive=adaptive, **config)
        self.sampling = selection.sequence.SamplingParams

    def counters(self):
        stats = self.engine.speculation
        return {**super().counters(), "speculative_proposed": stats.proposed, "speculative_accepted": stats.accepted,
                "speculative_verifications": stats.verifications}


class TensorParallel(Week3):
    """Day 4.4's `TensorParallelEngine` on rank 0 of `model.group`; `close` stops the other ranks' loops."""

    def __init__(self, selection, model, tokenizer, **config):
        self.engine = selection.distributed_engine.TensorParallelEngine(model, tokenizer,
                                                                        selection.engine.EngineConfig(**config))
        self.sampling = selection.sequence.SamplingParams

    def close(self):
        self.engine.shutdown()


# ---------------------------------------------------------------- day 2.7


class Day27(Adapter):
    """Day 2.7's `batch.SlotScheduler` of `selection` (decode slots, chunked prefill of `prefill_step` tokens)."""

    def __init__(self, selection, model, tokenizer, *, batch_size: int, max_seq_len: int, prefill_step: int,
                 policy=None):
        self.scheduler = selection.batch.SlotScheduler(model, tokenizer, max_seq_len=max_seq_len, batch_size=batch_size,
                                                   prefill_step=prefill_step, policy=policy, log=lambda line: None)
        self.requests = {}  # unfinished ones, by index

    def add(self, idx, arrival):
        self.requests[idx] = self.scheduler.add_request(arrival.prompt, idx, max_tokens=arrival.max_tokens)

    def has_work(self):
        return self.scheduler.has_work()

    def step(self):
        before = {idx: len(r.output_tokens) for idx, r in self.requests.items()}
        self.scheduler.step()
        events = []
        for idx, request in list(self.requests.items()):
            events += [Event(idx, token, False) for token in request.output_tokens[before[idx]:]]
            if request.is_done:
                events.append(Event(idx, None, True))
                del self.requests[idx]
        return events

    def counters(self):
        stats = self.scheduler.stats.to_dict()
        return {"chunks": stats["chunks"], "avg_chunk_s": stats["avg_chunk_time"],
                "interleave_ratio": stats["interleave_ratio"]}


# ---------------------------------------------------------------- mlx-lm


class MlxLm(Adapter):
    """mlx-lm's `BatchGenerator` on mlx-lm's model: greedy, prefill in steps of `prefill_step` tokens."""

    def __init__(self, mlx_model, tokenizer, *, prefill_step: int = 2048, batch_size: int = 8):
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(mlx_model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                                        completion_batch_size=batch_size, prefill_batch_size=batch_size,
                                        prefill_step_size=prefill_step)
        self.uid_to_idx = {}

    def add(self, idx, arrival):
        (uid,) = self.generator.insert([arrival.prompt], [arrival.max_tokens])
        self.uid_to_idx[uid] = idx

    def has_work(self):
        return bool(self.uid_to_idx)

    def step(self):
        _, responses = self.generator.next()
        events = []
        for response in responses:
            idx = self.uid_to_idx[response.uid]
            finished = response.finish_reason is not None
            # A "stop" response carries the EOS token, which is not part of the output.
            events.append(Event(idx, None if response.finish_reason == "stop" else response.token, finished))
            if finished:
                del self.uid_to_idx[response.uid]
        return events

    def close(self):
        self.generator.close()
