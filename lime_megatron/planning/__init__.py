"""Planning a run before it starts (``--dry-run``): parameter and FLOP formulas, activation bytes,
the step-time model of the pipeline schedules, and the measurement of autograd's saved bytes that
checks them."""
