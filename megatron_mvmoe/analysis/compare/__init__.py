"""Comparison runs of the papers' variants: the suites (what each compares and the orderings the papers
report), the data recipe, the resumable run store, and the reports (paired intervals, orderings,
loss curves)."""
