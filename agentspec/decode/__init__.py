"""One decode step: ``step`` (the step runner shared by single requests and the batch
scheduler), ``policy`` (draft budgets, the cost cut), ``verify`` (greedy longest path, keyed
sampling and the reference rules)."""
