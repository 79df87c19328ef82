"""The one place a command, a lab or `compare` builds week 3's and day 4.1's engines from a selection.

`week3_engine` builds an `LLMEngine`, `speculative_engine` a `SpeculativeEngine`, of the selection's code
(the student's or the reference's): a change of either constructor is one edit here. The labs
(`benches/engines.py`) and the compare commands (`scripts/compare_week3.py`, `scripts/compare_week4.py`)
both build their engines here, so neither imports the other.
"""

from __future__ import annotations

# EngineConfig fields of a plain engine, whose plans depend on neither time nor prompt length: a fixed token budget,
# first come first served, no prefix cache. `EngineConfig()`'s defaults are the recommended engine (a budget that
# follows measured step times, shortest prefill first, prefix caching); a test or a lab about one mechanism asks for
# this plain engine and switches on what it measures. Tests (`tests/week3_fakes.py`) and labs share this one dict.
PLAIN_ENGINE = {"budget_policy": "fixed", "scheduling_policy": "fcfs", "enable_prefix_caching": False}


def week3_engine(selection, model, tokenizer, clock=None, **config):
    """An `LLMEngine` of `selection` (the student's or the reference's); `config` are `EngineConfig` fields.

    `clock` (default: the engine's) times its steps.
    """
    engine = selection.engine
    timing = {} if clock is None else {"clock": clock}
    return engine.LLMEngine(model, tokenizer, engine.EngineConfig(**config), **timing)


def speculative_engine(selection, model, tokenizer, proposer=None, num_speculative_tokens: int = 4, clock=None,
                       adaptive: bool = True, **config):
    """Day 4.1's `SpeculativeEngine` of `selection`: `proposer` (default prompt lookup) guessing up to k tokens,
    backing off where guesses fail (`adaptive`), or always guessing k (min_acceptance_rate 0)."""
    speculative = selection.speculative
    timing = {} if clock is None else {"clock": clock}
    speculation = speculative.SpeculativeConfig(num_speculative_tokens, **({} if adaptive else {"min_acceptance_rate": 0.0}))
    return speculative.SpeculativeEngine(model, tokenizer, selection.engine.EngineConfig(**config),
                                         speculation=speculation, proposer=proposer, **timing)
