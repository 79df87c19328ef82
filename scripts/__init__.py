"""Course tooling: test runner, grader, comparison, model fixtures, platform set-up.

The teaching packages (`tiny_llm`, `tiny_llm_ref`) never import from here.
"""
