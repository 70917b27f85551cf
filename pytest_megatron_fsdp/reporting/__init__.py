"""Reporting: run records, in-rank measuring, the summary table, JSON, JUnit properties, plot."""
