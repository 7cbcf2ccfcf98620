"""Looking inside trained models (paper §5.2-5.4): measures and their PNG plots."""
