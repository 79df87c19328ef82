"""Checks a maintainer runs to keep code, tests, book and README in step (book, skeleton, days, roadmap)."""
