"""Plant the bugs a student would make, one at a time, and check each costs most of what it is planted in.

    pdm run python -m maint.mutations                    # the honest solution, then every mutation
    pdm run python -m maint.mutations --list             # the mutations, by name (STALE: a patch that no longer applies)
    pdm run python -m maint.mutations eos-leaks-blocks   # some of them (the honest run comes first still)
    pdm run python -m maint.mutations --day 3.5          # the ones that must hurt day 3.5, graded on it alone
    pdm run python -m maint.mutations --day 4.3 4.4      # those of days 4.3 and 4.4 (tensor parallelism)
    pdm run python -m maint.mutations --day 4.1 4.2 --day-budget 300   # a busy machine: time is not what is checked

A submission shaped like the skeleton is written to a temporary directory: the skeleton's files, with
every module replaced by the reference's (every day written, honestly). It must score full marks on
every day the chosen mutations hurt. Then each mutation, a small textual patch of that submission's
code (the bug a student writes), is graded by the grader itself (`scripts/grade.py --src`, the course's
isolated pytest runner, its time limits included) on the days it must hurt, and must lose more than half
of what is at stake there: the whole day where the day has a "your stack so far" test (weeks 3 and 4,
whose every bug reaches the engine the student serves with) or the patch lies in provided code; else the
points of the tasks it is planted in (a day of weeks 1 and 2 scores each task on its own tests, so a bug
in one 5-point task of a 10-point day can fairly cost only its half). The table printed names, per
mutation and day, the points lost and the tests that failed.

A mutation must also cost only its own task and the day's "your stack so far": each patch lies in one
task's region of the reference (its `# BEGIN TASK` markers), and another task of the day that scores
less than on the honest tree is a LEAK where that task's tests take the other tasks from the reference
(`solution(week, day, task=N)`, weeks 3 and 4): a correct task paying for another one's bug. In weeks 1
and 2 a day's later task is built on its earlier ones (day 1.1's multi-head attention calls its
attention), and the tests grade them together: such a loss is printed as BUILDS-ON, not counted. A patch
in provided code belongs to no task; its per-task losses are printed, never counted as leaks.

A patch whose text is no longer in the reference is reported as stale (exit 1): rewrite it against
the new code (`--list` marks them without grading anything). Every mutation is a grading run of its
day, so the whole set takes a while; gradings run side by side, one per core (`--jobs N`), each in
its own scratch folder, and the lines come out in the list's order. Not part of CI.
Exit status: 0 when every mutation is caught, 1 when one is not (or is stale), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from course.course_map import DAYS, find_day
from course.selector import Task

REPO_ROOT = Path(__file__).resolve().parent.parent
SKELETON = REPO_ROOT / "src" / "tiny_llm"
REFERENCE = REPO_ROOT / "src_ref" / "tiny_llm_ref"
TASK_REGION = re.compile(r"# BEGIN TASK Week (\d+) Day (\d+) Task (\d+).*?# END TASK", re.S)
TEST_TASK = re.compile(r"test_task_(\d+)_")
GRADER_OPTIONS: list[str] = []  # passed to every grading run (main sets --day-budget from the command line)
WRITTEN_DAYS = [(d.week, d.day) for d in DAYS]  # the honest submission's days: all of them


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, as a student would describe what they wrote
    days: tuple[int, ...]  # the days of `week` it must cost most of the points of
    patches: tuple[tuple[str, str, str], ...]  # (module, text in the reference, replacement)
    week: int = 3

    @property
    def day_keys(self) -> list[tuple[int, int]]:
        return [(self.week, day) for day in self.days]

    def planted_tasks(self) -> set[Task]:
        """The tasks whose regions in the reference the patches change (none: provided code)."""
        tasks = set()
        for module, old, _ in self.patches:
            text = (REFERENCE / f"{module}.py").read_text()
            at = text.find(old)
            for region in TASK_REGION.finditer(text):
                if at >= 0 and region.start() <= at < region.end():
                    tasks.add(Task(int(region[1]), int(region[2]), int(region[3])))
        return tasks


MUTATIONS = [
    # Week 1: the model from array operations.
    Mutation("softmax-whole-array", "softmax normalized over the whole array, not along the axis", (1,), (
        ("basics", "    return e / mx.sum(e, axis=axis, keepdims=True)\n", "    return e / mx.sum(e)\n"),), week=1),
    Mutation("scale-without-sqrt", "attention scores scaled by 1/D instead of 1/sqrt(D)", (1,), (
        ("attention", "    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])\n",
         "    factor = scale if scale is not None else 1.0 / query.shape[-1]\n"),), week=1),
    Mutation("linear-without-transpose", "x multiplied by w, not by its transpose", (1,), (
        ("basics", "    y = x @ w.T\n", "    y = x @ w\n"),), week=1),
    Mutation("rope-offset-ignored", "RoPE rotates every input as if it started at position 0", (2,), (
        ("positional_encoding", "            positions = mx.arange(offset, offset + length)\n",
         "            positions = mx.arange(length)\n"),), week=1),
    Mutation("rope-traditional-as-halves", "the traditional layout pairs feature i with i + D/2, like the other one",
             (2,), (
        ("positional_encoding", "            x1, x2 = x[..., 0::2], x[..., 1::2]  # neighbouring features form a pair\n",
         "            x1, x2 = x[..., : d // 2], x[..., d // 2 :]\n"),), week=1),
    Mutation("causal-mask-top-left", "the causal mask ignores cached keys: query i sees keys 0 .. i", (3,), (
        ("attention", "    query_positions = mx.arange(L)[:, None] + (S - L)\n", "    query_positions = mx.arange(L)[:, None]\n"),),
             week=1),
    Mutation("gqa-heads-interleaved", "query head i shares key/value head i mod H, not i // n", (3,), (
        ("attention", "    query = query.reshape(*batch, h, n_rep, l, d)\n",
         "    query = query.reshape(*batch, n_rep, h, l, d).swapaxes(-4, -3)\n"),), week=1),
    Mutation("rms-over-everything", "RMSNorm's mean taken over the whole array, not each row", (4,), (
        ("layer_norm", "        mean_square = mx.mean(x32 * x32, axis=-1, keepdims=True)\n",
         "        mean_square = mx.mean(x32 * x32)\n"),), week=1),
    Mutation("silu-on-up", "SiLU applied to the up projection instead of the gate", (4,), (
        ("mlp", "        gated = silu(linear(x, self.w_gate)) * linear(x, self.w_up)\n",
         "        gated = linear(x, self.w_gate) * silu(linear(x, self.w_up))\n"),), week=1),
    Mutation("block-without-residual", "the attention's output replaces the residual stream instead of adding to it",
             (5,), (
        ("qwen2_week1", "        h = x + self.self_attn(self.input_layernorm(x), mask)\n",
         "        h = self.self_attn(self.input_layernorm(x), mask)\n"),), week=1),
    Mutation("qwen-without-rope", "queries and keys never rotated: the model cannot tell positions apart", (5,), (
        ("qwen2_week1", "        q = self.rope(q, offset=0)\n        k = self.rope(k, offset=0)\n", ""),), week=1),
    Mutation("generate-reads-first-row", "the next token read from the first position's logits, not the last's", (6,), (
        ("generate", "        logits = model(mx.array([tokens]))[:, -1, :]\n", "        logits = model(mx.array([tokens]))[:, 0, :]\n"),),
             week=1),
    Mutation("generate-past-eos", "the loop never stops at EOS: it keeps generating until max_tokens", (6,), (
        ("generate", "        if token in tokenizer.eos_token_ids:\n            break\n        tokens.append(token)\n",
         "        tokens.append(token)\n"),), week=1),
    Mutation("temperature-multiplies", "logits multiplied by the temperature instead of divided", (7,), (
        ("sampler", "        logits = logprobs / temp\n", "        logits = logprobs * temp\n"),), week=1),
    Mutation("top-p-counts-itself", "a token kept while the mass up to and including it is below top_p", (7,), (
        ("sampler", "            mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs\n",
         "            mass_before = mx.cumsum(sorted_probs, axis=-1)\n"),), week=1),
    Mutation("top-k-keeps-one-more", "top-k keeps the k + 1 most likely tokens", (7,), (
        ("sampler", "[..., top_k:]", "[..., top_k + 1 :]"),), week=1),
    # Week 2: the KV cache, serving metrics, quantization, flash attention and continuous batching.
    Mutation("cache-prepends", "new keys and values put before the cached ones", (1,), (
        ("kv_cache", "            keys = mx.concatenate([cached_keys, key], axis=2)\n"
                     "            values = mx.concatenate([cached_values, value], axis=2)\n",
         "            keys = mx.concatenate([key, cached_keys], axis=2)\n"
         "            values = mx.concatenate([value, cached_values], axis=2)\n"),), week=2),
    Mutation("offset-never-advances", "the generation loop never moves its offset past the tokens fed", (1,), (
        ("generate", "        offset += len(new_tokens)\n", ""),), week=2),
    Mutation("percentile-rounds-down", "a percentile is the sample below its rank, not interpolated", (2,), (
        ("metrics", "    return ordered[below] + (ordered[above] - ordered[below]) * weight\n", "    return ordered[below]\n"),),
             week=2),
    Mutation("tpot-counts-first-token", "time per output token divided by every token, the first included", (2,), (
        ("metrics", "        return (self.e2e_latency - self.ttft) / (self.output_tokens - 1)\n",
         "        return (self.e2e_latency - self.ttft) / self.output_tokens\n"),), week=2),
    Mutation("dequantize-without-biases", "dequantize multiplies by the scales and forgets the biases", (3,), (
        ("quantize", "    w = scales[..., None] * q + biases[..., None]\n", "    w = scales[..., None] * q\n"),), week=2),
    Mutation("flash-never-rescales", "the running sum and output not rescaled when a tile raises the maximum", (4,), (
        ("flash_attention", "        rescale = mx.exp(running_max - shift)\n", "        rescale = mx.ones_like(running_max)\n"),),
             week=2),
    Mutation("tile-mask-ignores-cache", "a tile's causal mask ignores the cached keys (S - L)", (4,), (
        ("flash_attention", "    query_positions = mx.arange(q_start, q_start + q_len)[:, None] + (S - L)\n",
         "    query_positions = mx.arange(q_start, q_start + q_len)[:, None]\n"),), week=2),
    Mutation("mask-sees-padding", "a request's row of the batch mask lets it attend to the left padding", (5,), (
        ("kv_cache", "    allowed = (columns >= seq_len - held) & (columns <= seq_len - length + rows)\n",
         "    allowed = columns <= seq_len - length + rows\n"),), week=2),
    Mutation("decode-offset-two", "a decode step moves the offset two tokens on", (6,), (
        ("batch", "        self.offset += 1\n        self.record_token(token)\n",
         "        self.offset += 2\n        self.record_token(token)\n"),), week=2),
    Mutation("retire-keeps-cache", "a finished request's slot freed without removing its cache", (6,), (
        ("batch", "        request = self.slots[slot]\n        for layer_cache in self.batch_cache:\n"
                  "            layer_cache.remove_request(slot)\n        self.slots[slot] = None\n",
         "        request = self.slots[slot]\n        self.slots[slot] = None\n"),), week=2),
    Mutation("chunk-positions-from-zero", "a chunk's positions start at 0, not at its offset", (7,), (
        ("batch", "    return mx.arange(offset, offset + chunk_len)\n", "    return mx.arange(chunk_len)\n"),), week=2),
    Mutation("whole-prompt-one-chunk", "the whole rest of the prompt prefilled in one chunk", (7,), (
        ("batch", "        chunk = self.prompt_tokens[start : start + self.prefill_max_step]\n",
         "        chunk = self.prompt_tokens[start:]\n"),), week=2),
    Mutation("chunk-ignores-decode-time", "the chunk size ignores the decode step's own time", (7,), (
        ("chunk_policy", "        budget = self.target_itl - (self.decode_seconds or 0.0)\n",
         "        budget = self.target_itl\n"),), week=2),
    Mutation("eos-leaks-blocks", "blocks not freed when a sequence ends by EOS", (1,), (
        ("scheduler", '            self.finish(seq, "stop")\n', "            self.running.remove(seq)\n"),)),
    Mutation("preempt-drops-output", "preemption drops the tokens generated so far", (2,), (
        ("scheduler", "        seq.num_computed_tokens = 0\n        seq.status = SequenceStatus.WAITING\n",
         "        seq.num_computed_tokens = 0\n        seq.output_token_ids.clear()\n"
         "        seq.status = SequenceStatus.WAITING\n"),)),
    Mutation("admit-without-free-blocks", "a waiting sequence admitted without checking free blocks", (1,), (
        ("scheduler", "        length = min(length, room)\n", ""),)),
    Mutation("prefills-before-decodes", "prefills planned before decodes (room kept for the decodes)", (1,), (
        ("scheduler", "        self.schedule_decodes(plan)\n        self.schedule_prefills(plan, budget - len(plan.decodes))\n",
         "        self.schedule_prefills(plan, budget - num_decoding)\n        self.schedule_decodes(plan)\n"),)),
    Mutation("oldest-preempted", "the oldest running sequence preempted instead of the newest", (1,), (
        ("scheduler", "                victim = self.running[-1]\n", "                victim = self.running[0]\n"),)),
    # Since the engine refactor the next three sit in provided code (engine.run, Scheduler.admit and
    # update_from_output's hook): a student no longer writes them, but the tests must still catch them.
    Mutation("failed-step-leaks", "a failed model call does not release the step's sequences", (1,), (
        ("engine", "        try:\n            result = self.runner.run(plan)\n        except BaseException:\n"
                   "            self.release_all()  # a failed step must not leak the blocks of the sequences it held\n"
                   "            raise\n",
         "        result = self.runner.run(plan)\n"),)),
    Mutation("no-observe-step", "the engine never feeds observe_step to the budget policy", (1,), (
        ("engine", "        self.scheduler.token_budget.observe_step(plan.num_tokens, plan.num_decoding, self.clock() - start,\n"
                   "                                                 plan.prefill_offset)\n",
         ""),)),
    Mutation("prefix-hooks-never-called", "the prefix-cache hooks never called at admission and after a step", (3,), (
        ("scheduler", "        cached = self.block_manager.reuse_cached_prefix(seq)\n", "        cached = 0\n"),
        ("scheduler", "        self.block_manager.record_lookup(seq, cached)\n", ""),
        ("scheduler", "            self.block_manager.cache_computed_blocks(seq)  # day 3.3: its new full blocks become shareable\n",
         ""),)),
    Mutation("seed-alone", "a seeded sequence re-seeded with its seed alone every step", (1,), (
        ("model_runner", "            seed_draw(params, len(seq.output_token_ids))",
         "            seed_draw(params, 0)"),)),
    Mutation("budget-ignores-decodes", "the prefill budget not reduced by the planned decodes", (1,), (
        ("scheduler", "        self.schedule_prefills(plan, budget - len(plan.decodes))\n",
         "        self.schedule_prefills(plan, budget)\n"),)),
    Mutation("hit-never-recorded", "a prefix-cache hit never recorded", (3,), (
        ("prefix_cache", "        self.hit_tokens += cached_tokens\n", ""),)),
    Mutation("shared-block-freed", "a block freed while another sequence shares it", (3,), (
        ("prefix_cache", "            if self.ref_counts[block] > 0:\n                continue\n", ""),)),
    Mutation("hash-ignores-parent", "a block's name is the hash of its tokens alone, not of its parent's name too",
             (3,), (
        ("prefix_cache", '    payload = parent_hash + b"".join(token.to_bytes(4, "little") for token in tokens)\n',
         '    payload = b"".join(token.to_bytes(4, "little") for token in tokens)\n'),)),
    Mutation("whole-prompt-from-cache", "a prompt of whole blocks served entirely from the cache (no last token "
             "left to compute)", (3,), (
        ("prefix_cache", "        usable = (seq.num_tokens - 1) // self.block_size\n",
         "        usable = seq.num_tokens // self.block_size\n"),)),
    Mutation("hit-left-on-free-list", "a cached block that nobody held is shared without taking it off the free list",
             (3,), (
        ("prefix_cache", "            if self.ref_counts[block] == 0:\n                del self.free_blocks[block]\n", ""),)),
    Mutation("reused-block-keeps-name", "a free block taken for new tokens keeps its old name in the cache", (3,), (
        ("prefix_cache", "            self.evict(block)\n", ""),)),
    Mutation("name-overwritten", "a name computed again by another sequence is moved to its block", (3,), (
        ("prefix_cache", "            if parent not in self.cached_blocks and block not in self.block_names:\n",
         "            if block not in self.block_names:\n"),)),
    Mutation("lru-evicts-newest", "freed named blocks go to the front of the free list (evicted first), unnamed to the back",
             (3,), (
        ("prefix_cache", "            if block not in self.block_names:\n                self.free_blocks.move_to_end(block, last=False)\n",
         "            if block in self.block_names:\n                self.free_blocks.move_to_end(block, last=False)\n"),)),
    Mutation("priority-ignored-on-preemption", "priorities ignored on preemption: any running sequence is a victim",
             (4,), (
        ("scheduler", "        while self.running and self.order.outranks(seq, self.running[-1]) and not self.can_admit(seq):\n",
         "        while self.running and not self.can_admit(seq):\n"),)),
    Mutation("priority-never-preempts", "a more urgent request never takes slots or blocks from a less urgent one",
             (4,), (
        ("scheduler", "        while self.running and self.order.outranks(seq, self.running[-1]) and not self.can_admit(seq):\n"
                      "            self.preempt(self.running[-1], plan)\n", ""),)),
    Mutation("shortest-first-ignores-length", "shortest prefill first ranked by priority and arrival only", (4,), (
        ("order_policy", "        return (-self.effective_priority(seq), seq.num_uncomputed_tokens, self.arrival_step[seq])\n",
         "        return (-self.effective_priority(seq), 0, self.arrival_step[seq])\n"),)),
    Mutation("shortest-first-by-prompt-length", "shortest prefill first by the whole prompt's length, not what is left",
             (4,), (
        ("order_policy", "        return (-self.effective_priority(seq), seq.num_uncomputed_tokens, self.arrival_step[seq])\n",
         "        return (-self.effective_priority(seq), seq.num_tokens, self.arrival_step[seq])\n"),)),
    Mutation("shortest-first-before-priority", "length ranked before priority", (4,), (
        ("order_policy", "        return (-self.effective_priority(seq), seq.num_uncomputed_tokens, self.arrival_step[seq])\n",
         "        return (seq.num_uncomputed_tokens, -self.effective_priority(seq), self.arrival_step[seq])\n"),)),
    Mutation("shorter-takes-blocks", "a shorter prompt outranks a longer one and preempts it", (4,), (
        ("order_policy", "        return PriorityPolicy.rank(self, seq) < PriorityPolicy.rank(self, other)\n",
         "        return self.rank(seq) < self.rank(other)\n"),)),
    Mutation("no-aging", "priorities never age: a low priority waits as long as anything more urgent arrives", (4,), (
        ("order_policy", "        return seq.priority + waited // self.aging_steps\n",
         "        return seq.priority\n"),)),
    Mutation("aging-alike", "every request ages by the steps since the engine started, so none gains on another", (4,), (
        ("order_policy", "        waited = self.num_steps - self.arrival_step[seq]\n",
         "        waited = self.num_steps\n"),)),
    Mutation("room-one-victim", "room for an urgent request made with at most one preemption", (4,), (
        ("scheduler", "        while self.running and self.order.outranks(seq, self.running[-1]) and not self.can_admit(seq):\n",
         "        if self.running and self.order.outranks(seq, self.running[-1]) and not self.can_admit(seq):\n"),)),
    Mutation("room-ignores-decode-blocks", "room for an urgent request counts its chunk's blocks, not the decodes' new ones",
             (4,), (
        ("scheduler", "        return decode_blocks + chunk_blocks - len(seq.block_table) <= self.block_manager.num_free_blocks\n",
         "        return chunk_blocks - len(seq.block_table) <= self.block_manager.num_free_blocks\n"),)),
    Mutation("later-jumps-queue", "most urgent first by a reversed sort of (priority, arrival): the later arrival first "
             "among equals", (4,), (
        ("order_policy", "        return sorted(seqs, key=self.rank)\n",
         "        return sorted(seqs, key=lambda seq: (self.effective_priority(seq), self.arrival_step[seq]), reverse=True)\n"),)),
    Mutation("waiting-before-partway", "waiting sequences ranked before part-way prompts among equals", (4,), (
        ("scheduler", "        for seq in self.order.order(partway + list(self.waiting)):\n",
         "        for seq in self.order.order(list(self.waiting) + partway):\n"),)),
    # Day 3.4's goodput budget (token_budget.py): the targets' roles swapped; the queue's age never read.
    Mutation("goodput-targets-swapped", "the TTFT target used as the step's ceiling and the ITL target as the wait's scale",
             (4,), (
        ("token_budget", "        ttft = self.ttft_target(num_decoding)\n        urgency = min(1.0, waited / ttft) if ttft > 0 else 1.0\n",
         "        ttft = self.target(num_decoding)\n        urgency = min(1.0, waited / ttft) if ttft > 0 else 1.0\n"),
        ("token_budget", "        return base + (self.target(num_decoding) - base) * (1 + urgency) / 2\n",
         "        return base + (self.ttft_target(num_decoding) - base) * (1 + urgency) / 2\n"),)),
    Mutation("goodput-ignores-age", "every step takes the whole room below the ITL target, however long anyone waited",
             (4,), (
        ("token_budget", "        urgency = min(1.0, waited / ttft) if ttft > 0 else 1.0\n", "        urgency = 1.0\n"),)),
    # Day 3.5: the server. The first and last live in provided code (`Completion.tokens`, the handler's token loop);
    # the stop string and the detokenizer are in text_stream.py.
    Mutation("finish-reason-always-stop", "every finished request reported with finish reason 'stop'", (5,), (
        ("server", '                    handle.finish_reason = "length" if output.finish_reason == "length" else "stop"\n',
         '                    handle.finish_reason = "stop"\n'),)),
    Mutation("stop-string-kept", "the text is cut after the stop string instead of before it", (5,), (
        ("text_stream", "        return min(found), True\n", "        return len(text), True\n"),)),
    Mutation("detokenizer-repeats", "the detokenizer's offsets never move: each piece repeats the text so far", (5,), (
        ("text_stream", "        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)\n", ""),)),
    Mutation("output-sent-twice", "the engine thread sends each step output twice", (5,), (
        ("server", "                self.send(handle, output)\n",
         "                self.send(handle, output)\n                self.send(handle, output)\n"),)),
    Mutation("abort-forgets-only", "an abort forgets the handle but never calls engine.abort (blocks kept)", (5,), (
        ("server", '            elif command == "abort" and self.handles.pop(argument, None) is not None:\n'
                   "                self.engine.abort(argument)\n",
         '            elif command == "abort":\n                self.handles.pop(argument, None)\n'),)),
    Mutation("disconnect-not-aborted", "a client that leaves is not aborted: its request runs to max_tokens", (5,), (
        ("server", "            self.server.close(handle, self.arrival, finished=engine_done and not text.stopped)\n",
         "            self.server.close(handle, self.arrival, finished=not text.stopped)\n"),)),
    # Day 4.1: speculative decoding.
    Mutation("acceptance-off-by-one", "each guess compared with the target's token one row later", (1,), (
        ("speculative", "    for guess, target in zip(draft, target_tokens):\n",
         "    for guess, target in zip(draft, target_tokens[1:]):\n"),), week=4),
    Mutation("no-bonus-token", "no token of the target's own when every guess is accepted", (1,), (
        ("speculative", "    accepted.append(target_tokens[len(accepted)])\n    return accepted\n",
         "    if len(accepted) < len(draft):\n        accepted.append(target_tokens[len(accepted)])\n    return accepted\n"),),
             week=4),
    Mutation("roll-back-forgotten", "the sequence's progress not rolled back after a verification", (1,), (
        ("speculative", "        self.scheduler.roll_back(seq, chunk.start + len(accepted))\n", ""),), week=4),
    Mutation("roll-back-keeps-guesses", "rolled back to the end of the verify chunk: rejected positions kept", (1,), (
        ("speculative", "        self.scheduler.roll_back(seq, chunk.start + len(accepted))\n",
         "        self.scheduler.roll_back(seq, chunk.start + chunk.length)\n"),), week=4),
    Mutation("proposals-ignore-budget", "guesses planned without counting them in the step's budget", (1,), (
        ("speculative", "            most = min(self.num_speculative_tokens, room, ",
         "            most = min(self.num_speculative_tokens, "),), week=4),
    Mutation("proposals-ignore-blocks", "guesses not cut to what the held and free blocks can take", (1,), (
        ("speculative", "            draft = draft[: held - seq.num_tokens]\n", ""),), week=4),
    Mutation("residual-keeps-guess", "after a rejection, the next token drawn from p instead of max(p - q, 0)", (1,), (
        ("speculative", "        residual = mx.maximum(p - q, 0.0)\n", "        residual = p\n"),), week=4),
    Mutation("acceptance-ratio-inverted", "a guess accepted with probability q/p instead of p/q", (1,), (
        ("speculative", "        ratio = p[guess] / q[guess]\n", "        ratio = q[guess] / p[guess]\n"),), week=4),
    Mutation("ngram-matches-itself", "prompt lookup finds the suffix itself (so never anything after it)", (1,), (
        ("speculative", "            for start in range(len(tokens) - n - 1, -1, -1):\n",
         "            for start in range(len(tokens) - n, -1, -1):\n"),), week=4),
    Mutation("counts-the-bonus", "the target's own token counted as an accepted guess", (1,), (
        ("speculative", "        self.speculation.accepted += len(accepted) - 1\n",
         "        self.speculation.accepted += len(accepted)\n"),), week=4),
    Mutation("appends-past-the-end", "accepted tokens appended after one finished the sequence", (1,), (
        ("speculative", "            if outputs[-1].finished:\n                return outputs  # finishing freed every block\n",
         ""),), week=4),
    Mutation("sampling-draws-from-python-random", "rejection sampling's coin drawn from Python's random, not MLX's "
             "(seeded by the engine)", (1,), (
        ("speculative", "import math\n", "import math\nimport random\n"),
        ("speculative", "        if mx.random.uniform().item() < ratio.item():\n",
         "        if random.random() < ratio.item():\n"),), week=4),
    Mutation("residual-break-not-return", "after the replacement token, break out of the loop (so the bonus draw "
             "from the last row follows it) instead of returning", (1,), (
        ("speculative", "        accepted.append(mx.random.categorical(mx.log(residual / residual.sum())).item())\n"
                        "        return accepted\n",
         "        accepted.append(mx.random.categorical(mx.log(residual / residual.sum())).item())\n"
         "        break\n"),), week=4),
    Mutation("guesses-up-to-max-tokens", "a sequence guesses up to max_tokens - emitted, not one fewer", (1,), (
        ("speculative", "seq.sampling.max_tokens - len(seq.output_token_ids) - 1)",
         "seq.sampling.max_tokens - len(seq.output_token_ids))"),), week=4),
    Mutation("tracker-never-fed", "the acceptance tracker never told how a verification went", (1,), (
        ("speculative", "        self.tracker.observe(seq.request_id, len(chunk.draft), len(accepted) - 1)\n", ""),),
             week=4),
    Mutation("tracker-counts-the-bonus", "the tracker told the target's own token was an accepted guess", (1,), (
        ("speculative", "        self.tracker.observe(seq.request_id, len(chunk.draft), len(accepted) - 1)\n",
         "        self.tracker.observe(seq.request_id, len(chunk.draft), len(accepted))\n"),), week=4),
    Mutation("ngram-earliest-match", "prompt lookup takes the earliest earlier occurrence, not the latest", (1,), (
        ("speculative", "            for start in range(len(tokens) - n - 1, -1, -1):\n",
         "            for start in range(len(tokens) - n):\n"),), week=4),
    Mutation("ngram-shortest-first", "prompt lookup tries the shortest suffix first", (1,), (
        ("speculative", "        for n in range(self.max_ngram, self.min_ngram - 1, -1):\n",
         "        for n in range(self.min_ngram, self.max_ngram + 1):\n"),), week=4),
    Mutation("finished-then-rolled-back", "Task 5 read literally: stop appending at the end, then roll back the "
             "finished sequence", (1,), (
        ("speculative", "                return outputs  # finishing freed every block\n", "                break\n"),),
             week=4),
    Mutation("roll-back-before-append", "rolled back before the accepted tokens are appended", (1,), (
        ("speculative", "        outputs = []\n        for token in accepted:\n",
         "        self.scheduler.roll_back(seq, chunk.start + len(accepted))\n        outputs = []\n"
         "        for token in accepted:\n"),
        ("speculative", "        # The newest token and the accepted guesses are in the cache; the last token (the target's own) is not.\n"
                        "        self.scheduler.roll_back(seq, chunk.start + len(accepted))\n", ""),), week=4),
    # Day 4.2: the quantized pool.
    Mutation("group-size-ignored", "the pool quantizes in groups of 64 whatever the head's size", (2,), (
        ("quantized_kv", "            for part, new_part in zip(stored, quantize_kv(new, self.group_size, self.bits)):\n",
         "            for part, new_part in zip(stored, quantize_kv(new, KV_GROUP_SIZE, self.bits)):\n"),
        ("quantized_kv", "*(part[slots] for part in stored), self.group_size, self.bits, self.dtype)",
         "*(part[slots] for part in stored), KV_GROUP_SIZE, self.bits, self.dtype)"),), week=4),
    Mutation("gather-assumes-8-bits", "gather dequantizes as 8-bit whatever the pool's bits", (2,), (
        ("quantized_kv", "*(part[slots] for part in stored), self.group_size, self.bits, self.dtype)",
         "*(part[slots] for part in stored), self.group_size, 8, self.dtype)"),), week=4),
    Mutation("scale-bias-swapped", "dequantize given the biases as scales and the scales as biases", (2,), (
        ("quantized_kv", "    return dequantize(packed, scales.astype(dtype), biases.astype(dtype), group_size, bits)\n",
         "    return dequantize(packed, biases.astype(dtype), scales.astype(dtype), group_size, bits)\n"),), week=4),
    Mutation("tokens-and-heads-swapped", "keys quantized head-major, stored back token-major", (2,), (
        ("quantized_kv", "quantize(x.reshape(tokens * heads, head_dim), group_size, bits)",
         "quantize(x.swapaxes(0, 1).reshape(tokens * heads, head_dim), group_size, bits)"),), week=4),
    Mutation("values-stored-as-keys", "the pool stores the keys in the values' place too", (2,), (
        ("quantized_kv", "(self.values[layer], values)):", "(self.values[layer], keys)):"),), week=4),
    Mutation("bytes-keys-only", "bytes per token count the keys and forget the values", (2,), (
        ("quantized_kv", "    return 2 * num_layers * num_kv_heads * per_head\n",
         "    return num_layers * num_kv_heads * per_head\n"),), week=4),
    Mutation("scales-not-counted", "bytes per token forget the scales and biases", (2,), (
        ("quantized_kv", "        per_head = head_dim * kv_bits // 8 + 2 * groups * SCALE_DTYPE.size\n",
         "        per_head = head_dim * kv_bits // 8\n"),), week=4),
    Mutation("gather-always-float32", "gather dequantizes to float32 whatever the model's dtype", (2,), (
        ("quantized_kv", "*(part[slots] for part in stored), self.group_size, self.bits, self.dtype)",
         "*(part[slots] for part in stored), self.group_size, self.bits, mx.float32)"),), week=4),
    Mutation("bytes-one-group-per-head", "bytes per token count one scale and bias per head, whatever group_size",
             (2,), (
        ("quantized_kv", "        groups = head_dim // kv_group_size(head_dim, group_size)\n", "        groups = 1\n"),),
             week=4),
    Mutation("kv16-at-model-dtype", "a kv_bits=16 pool counted at the model's dtype, not float16's", (2,), (
        ("quantized_kv", "        per_head = head_dim * (dtype.size if kv_bits is None else mx.float16.size)\n",
         "        per_head = head_dim * dtype.size\n"),), week=4),
    Mutation("one-group-per-head-quantized", "keys quantized in one group per head, whatever group_size", (2,), (
        ("quantized_kv", "quantize(x.reshape(tokens * heads, head_dim), group_size, bits)",
         "quantize(x.reshape(tokens * heads, head_dim), head_dim, bits)"),), week=4),
    # Day 4.3: sharding.
    Mutation("tp-split-interleaved", "a column-parallel split keeps every N-th row, not a contiguous block", (3,), (
        ("tensor_parallel", "    share = weight.shape[0] // world_size\n    return weight[rank * share : (rank + 1) * share]\n",
         "    return weight[rank::world_size]\n"),), week=4),
    Mutation("tp-second-matmuls-split-by-outputs", "o_proj and down_proj split by outputs, like q/k/v and gate/up",
             (3,), (
        ("tensor_parallel", "            own_copy(split_inputs(mlp.w_down, rank, world_size)),\n",
         "            own_copy(split_outputs(mlp.w_down, rank, world_size)),\n"),
        ("tensor_parallel", "            own_copy(split_inputs(attention.wo, rank, world_size)),\n",
         "            own_copy(split_outputs(attention.wo, rank, world_size)),\n"),), week=4),
    Mutation("tp-mlp-without-all-sum", "the MLP's partial output returned without the all_sum", (3,), (
        ("tensor_parallel", "        return mx.distributed.all_sum(self.local(x), group=self.group)\n",
         "        return self.local(x)\n"),), week=4),
    Mutation("tp-kv-heads-not-divided", "the model's KV pool keeps every KV head on every rank", (3,), (
        ("tensor_parallel", "        self.num_kv_heads //= group.size()\n", ""),), week=4),
    # Day 4.4: the engine across ranks.
    Mutation("plan-table-before-tokens", "a chunk's block table written before its token ids", (4,), (
        ("distributed_engine", "        message += chunk.token_ids\n        message += table\n",
         "        message += table\n        message += chunk.token_ids\n"),), week=4),
    Mutation("plan-not-broadcast", "rank 0 runs its own plan and never sends it", (4,), (
        ("distributed_engine", "        received = decode_plan(self.exchange(encode_plan(plan, self.capacity)))\n",
         "        received = plan\n"),), week=4),
    Mutation("follower-reads-its-own-message", "all_sum taken as in-place (as torch.distributed's): rank 1 decodes "
             "the zeros it sent, a stale plan", (4,), (
        ("distributed_engine", "        while (plan := decode_plan(self.exchange(mx.zeros(self.capacity, dtype=mx.int32)))) "
                               "is not None:\n",
         "        message = mx.zeros(self.capacity, dtype=mx.int32)\n"
         "        while self.exchange(message) is not None and (plan := decode_plan(message)) is not None:\n"),),
             week=4),
    Mutation("follower-samples", "rank 1 samples its own token from the logits it computed", (4,), (
        ("distributed_engine", "            self.forward(plan)\n            steps += 1\n",
         "            self.runner.sample(self.forward(plan), [chunk.seq for chunk in plan.chunks if chunk.samples])\n"
         "            steps += 1\n"),), week=4),
    Mutation("mask-one-state-behind", "the mask of the state before the newest token (the state lags one token)",
             (5,), (
        ("structured", "    for token in seq.output_token_ids[consumed:]:\n        state = constraint.next_state(state, token)\n"
                       "    seq.constraint_progress = (len(seq.output_token_ids), state)\n",
         "    for token in seq.output_token_ids[consumed:-1]:\n        state = constraint.next_state(state, token)\n"
         "    seq.constraint_progress = (max(len(seq.output_token_ids) - 1, 0), state)\n"),), week=4),
    Mutation("eos-allowed-early", "EOS allowed in every state, not only accepting ones", (5,), (
        ("structured", "        if automaton.accepts(state):\n            allowed[vocab.eos_token_ids] = True\n",
         "        allowed[vocab.eos_token_ids] = True\n"),), week=4),
    Mutation("utf8-split-refused", "tokens that are not whole UTF-8 characters never allowed (walked as text)", (5,), (
        ("structured", "            allowed[level.tokens] = states.take(level.ends) != DEAD\n",
         "            whole = [vocab.token_bytes[t].decode('utf-8', 'replace').encode() == vocab.token_bytes[t]\n"
         "                     for t in level.tokens]\n"
         "            allowed[level.tokens] = (states.take(level.ends) != DEAD) & np.array(whole, dtype=bool)\n"),), week=4),
    Mutation("state-from-kv-progress", "the state advanced by the tokens the KV cache lacks (num_computed_tokens): "
             "a preemption replays the output into it", (5,), (
        ("structured", "    for token in seq.output_token_ids[consumed:]:\n",
         "    for token in seq.output_token_ids[max(seq.num_computed_tokens - len(seq.prompt_token_ids), 0):]:\n"),),
             week=4),
]


def written_modules() -> set[str]:
    return {module for d in DAYS if (d.week, d.day) in WRITTEN_DAYS for module in d.modules}


def honest_submission(dest: Path) -> None:
    """The skeleton's files, with the modules of WRITTEN_DAYS the reference's: every day written."""
    dest.mkdir(parents=True)
    for path in SKELETON.glob("*.py"):
        shutil.copyfile(path, dest / path.name)
    for module in written_modules():
        shutil.copyfile(REFERENCE / f"{module}.py", dest / f"{module}.py")


def plant(dest: Path, mutation: Mutation) -> list[str]:
    """Apply the mutation's patches to the submission in `dest`; the patches whose text is missing (stale)."""
    stale = []
    for module, old, new in mutation.patches:
        path = dest / f"{module}.py"
        text = path.read_text()
        if text.count(old) != 1:
            stale.append(f"{module}.py: {old.strip().splitlines()[0]!r} found {text.count(old)} times, not once")
            continue
        path.write_text(text.replace(old, new))
    return stale


def grade(submission: Path, day_keys: list[tuple[int, int]], work: Path) -> dict[tuple[int, int], dict] | str:
    """Grade the days with the grader, one run per week: (week, day) -> {"lost", "max", "failed": [(test, lost)]}.
    `work` is this grading's own folder (its report goes there: gradings run side by side)."""
    results = {}
    for week in sorted({w for w, _ in day_keys}):
        graded = grade_week(submission, week, [d for w, d in day_keys if w == week], work)
        if isinstance(graded, str):
            return graded
        results.update({(week, day): result for day, result in graded.items()})
    return results


def grade_week(submission: Path, week: int, days: list[int], work: Path, attempts: int = 2) -> dict[int, dict] | str:
    """Grade `days` of `week` with the grader: day -> {"lost", "max", "failed": [(test, points lost)]}.

    A grading run that fails on the grader's side (exit 2: on a busy machine, a test process that does
    not start in time) is tried again once; if it fails again, the grader's last lines (a str).
    """
    work.mkdir(parents=True, exist_ok=True)
    report = work / f"results-week{week}.json"
    command = [sys.executable, "-m", "scripts.grade", "--src", str(submission), "--week", str(week),
               "--day", *map(str, days), "--json", str(report), *GRADER_OPTIONS]
    for _ in range(attempts):
        report.unlink(missing_ok=True)
        finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
        if finished.returncode == 0 and report.exists():
            break
    else:
        lines = (finished.stdout + finished.stderr).strip().splitlines()
        return f"the grader failed (status {finished.returncode}): " + " | ".join(lines[-6:])
    results = {day: {"lost": 0.0, "max": float(sum(find_day(week, day).points.values())), "failed": [], "by_task": {}}
               for day in days}
    for test in json.loads(report.read_text())["tests"]:
        day = int(test["tags"][1].split(".")[1])
        if test["score"] < test["max_score"]:
            lost = test["max_score"] - test["score"]
            name = test["name"].split(": ", 1)[1]
            results[day]["lost"] += lost
            results[day]["failed"].append((name, lost))
            task = TEST_TASK.match(name)
            number = int(task[1]) if task else 0
            results[day]["by_task"][number] = results[day]["by_task"].get(number, 0.0) + lost
    return results


def grade_honest(honest: Path, day_keys: list[tuple[int, int]], work: Path, pool: ThreadPoolExecutor
                 ) -> dict[tuple[int, int], dict] | str:
    """The honest submission graded on `day_keys`, each week in a grading of its own, side by side."""
    weeks = sorted({w for w, _ in day_keys})
    graded = pool.map(lambda week: grade(honest, [k for k in day_keys if k[0] == week], work / f"honest-week{week}"),
                      weeks)
    results: dict[tuple[int, int], dict] = {}
    for result in graded:
        if isinstance(result, str):
            return result
        results.update(result)
    return results


def try_mutation(mutation: Mutation, honest: Path, work: Path, baseline: dict) -> tuple[list[str], int]:
    """Plant `mutation` in a copy of the honest submission and grade it: the lines to print, the problems found."""
    submission = work / mutation.name / "tiny_llm"
    shutil.copytree(honest, submission)
    stale = plant(submission, mutation)
    if stale:
        return [f"STALE {mutation.name}: " + "; ".join(stale)], 1
    results = grade(submission, mutation.day_keys, work / mutation.name)
    if isinstance(results, str):
        return [f"ERROR {mutation.name}: {results}"], 1
    lines, problems = [], 0
    planted = ", ".join(sorted(str(t) for t in mutation.planted_tasks())) or "provided code"
    for (week, day), result in results.items():
        stake = at_stake(mutation, (week, day))
        caught = result["lost"] > stake / 2
        leaked = leaks(mutation, (week, day), result, baseline[(week, day)])
        built_on = builds_on(mutation, (week, day), leaked)
        leaked = {number: lost for number, lost in leaked.items() if number not in built_on}
        problems += not caught or bool(leaked)
        lines.append(f"{'ok  ' if caught else 'MISS'} {mutation.name} ({mutation.what}; in {planted}), day {week}.{day}: "
                     f"lost {result['lost']:g} ({stake:g} at stake, {result['max']:g} in the day; "
                     f"{describe_tasks(result['by_task'])}); failed: {describe_failures(result['failed']) or 'nothing'}")
        if leaked:
            lines.append(f"LEAK {mutation.name}, day {week}.{day}: a correct task pays for it: {describe_tasks(leaked)}")
        if built_on:
            lines.append(f"BUILDS-ON {mutation.name}, day {week}.{day}: a later task of the day calls the planted one: "
                         f"{describe_tasks(built_on)}")
    return lines, problems


def stack_tasks(week: int, day: int) -> set[int]:
    """The day's "your stack so far" task numbers: no code of their own, they pay for every bug by design."""
    source = (REPO_ROOT / "tests" / f"test_week_{week}_day_{day}.py").read_text()
    return {int(n) for n in re.findall(r"def test_task_(\d+)_your_stack_so_far", source)}


def at_stake(mutation: Mutation, key: tuple[int, int]) -> float:
    """The points `mutation` must cost more than half of on day `key`: the whole day where it has a "your stack
    so far" test or the patch is in provided code, else the points of the day's tasks it is planted in."""
    points = find_day(*key).points
    planted = {task.number for task in mutation.planted_tasks() if task.day_key == key}
    if stack_tasks(*key) or not planted:
        return float(sum(points.values()))
    return float(sum(points[number] for number in planted))


def builds_on(mutation: Mutation, key: tuple[int, int], leaked: dict[int, float]) -> dict[int, float]:
    """The part of `leaked` that is a later task built on the planted one, on a day whose tests grade its tasks
    together (weeks 1 and 2: no "your stack so far" test, no `solution(week, day, task=N)`)."""
    planted = [task.number for task in mutation.planted_tasks() if task.day_key == key]
    if stack_tasks(*key) or not planted:
        return {}
    return {number: lost for number, lost in leaked.items() if number > min(planted)}


def leaks(mutation: Mutation, key: tuple[int, int], result: dict, honest: dict) -> dict[int, float]:
    """Task number -> points lost beyond the honest tree, for each task of the day the mutation is not planted
    in (nor a stack task). Empty for a mutation in provided code: it belongs to no task."""
    tasks = mutation.planted_tasks()
    if not tasks:
        return {}
    excluded = {t.number for t in tasks if t.day_key == key} | stack_tasks(*key)
    return {number: lost - honest.get("by_task", {}).get(number, 0.0) for number, lost in result["by_task"].items()
            if number not in excluded and lost > honest.get("by_task", {}).get(number, 0.0)}


def describe_tasks(by_task: dict[int, float]) -> str:
    """'task 2 -5, task 6 -60': points lost per task."""
    return ", ".join(f"task {number or '?'} -{lost:g}" for number, lost in sorted(by_task.items())) or "none"


def describe_failures(failed: list[tuple[str, float]]) -> str:
    """The failed tests, grouped by function: 'test_x (3 cases, 12.5 points), test_y (60 points)'."""
    by_function: dict[str, list[float]] = {}
    for name, lost in failed:
        by_function.setdefault(name.split("[")[0], []).append(lost)
    parts = []
    for function, losses in by_function.items():
        cases = f"{len(losses)} cases, " if len(losses) > 1 else ""
        parts.append(f"{function} ({cases}{sum(losses):g} points)")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run python -m maint.mutations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="only these mutations (default: all)")
    parser.add_argument("--day", nargs="+", default=None, metavar="W.D",
                        help="only the mutations that hurt these days, e.g. 4.3 4.4 (default: all)")
    parser.add_argument("--day-budget", type=float, default=None, metavar="SECONDS",
                        help="each day's time budget, passed to the grader (default: the grader's, 3x the recorded "
                             "honest run plus one test's limit: too tight on a busy machine, where a cut-off test "
                             "reads as a caught bug)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), metavar="N",
                        help="gradings run at once (default: one per core, %(default)s here; a grading keeps about "
                             "one core busy, so more than the cores makes each slower than its day's budget expects)")
    parser.add_argument("--list", action="store_true",
                        help="list the mutations, each marked STALE whose patch no longer applies, and exit")
    return parser


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def list_mutations(mutations: list[Mutation]) -> int:
    """Print each mutation (STALE first where a patch no longer applies: found by planting, nothing graded)."""
    stale_count = 0
    with tempfile.TemporaryDirectory(prefix="tiny-llm-mutations-") as tmp:
        honest_submission(Path(tmp) / "honest")
        for mutation in mutations:
            submission = Path(tmp) / mutation.name
            shutil.copytree(Path(tmp) / "honest", submission)
            stale = plant(submission, mutation)
            stale_count += bool(stale)
            planted = ", ".join(sorted(str(t) for t in mutation.planted_tasks())) or "provided code"
            print(f"{'STALE ' if stale else ''}{mutation.name:36} day(s) "
                  f"{', '.join(f'{w}.{d}' for w, d in mutation.day_keys)} ({planted}): {mutation.what}"
                  + "".join(f"\n      {line}" for line in stale))
    print(f"{len(mutations)} mutations, {stale_count} stale")
    return 1 if stale_count else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        build_parser().error(f"unknown mutation(s): {', '.join(sorted(unknown))} (see --list)")
    if args.jobs < 1:
        build_parser().error("--jobs must be at least 1")
    if args.day_budget is not None:
        GRADER_OPTIONS[:] = ["--day-budget", str(args.day_budget)]
    days = {tuple(int(part) for part in day.split(".")) for day in args.day or []}
    chosen = [m for m in MUTATIONS if (not args.names or m.name in args.names)
              and (not days or days & set(m.day_keys))]
    if args.list:
        return list_mutations(chosen)
    problems, started = 0, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tiny-llm-mutations-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        honest = Path(tmp) / "honest"
        honest_submission(honest)
        baseline = grade_honest(honest, sorted({key for m in chosen for key in m.day_keys}), Path(tmp), pool)
        if isinstance(baseline, str):
            print(f"FAIL honest solution: {baseline}")
            return 1
        for (week, day), result in baseline.items():
            ok = result["lost"] == 0
            problems += not ok
            print(f"{'ok  ' if ok else 'FAIL'} honest solution, day {week}.{day}: "
                  f"{result['max'] - result['lost']:g}/{result['max']:g}"
                  + ("" if ok else f"; failed: {describe_failures(result['failed'])}"), flush=True)
        # Each mutation is graded on its own (--jobs at once); the lines come out in MUTATIONS' order.
        for lines, found in pool.map(lambda m: try_mutation(m, honest, Path(tmp), baseline), chosen):
            problems += found
            print("\n".join(lines), flush=True)
    print(f"mutations: {'every one caught, no leak' if not problems else f'{problems} problem(s)'} "
          f"({len(chosen)} mutations in {time.monotonic() - started:.0f} s, {args.jobs} at once)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
