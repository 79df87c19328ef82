"""Libraries the course's commands, checks, tests and benchmarks share: the course map, the BLAS set-up,
model fixtures and the isolated pytest runner. The teaching packages (`tiny_llm`, `tiny_llm_ref`) never
import from here."""
