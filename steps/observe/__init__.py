"""Seeing a run: its committed metrics and step reports as TensorBoard scalars, tracker runs (MLflow, W&B) and plots.

Everything here reads what the loop has committed (metrics/iter-N.json and the reports beside it), so writing
it again gives the same points: a retried step adds none and loses none.
"""
