"""Looking at checkpoints without converting them: inspect, stats, verify, diff, layout
drawings, tables, and the bundled demo."""
