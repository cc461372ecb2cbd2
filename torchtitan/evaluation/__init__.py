"""Downstream evaluation: multiple-choice tasks in lm-evaluation-harness' document shape
(``tasks.py``), encoded and scored as lm-eval scores them (``scoring.py``). The training loop's
evaluator is ``torchtitan/train/downstream.py``."""
