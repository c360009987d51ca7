"""The head atlas: every head of a model labelled by every detector that applies, with nulls (docs/atlas.md).
``atlas`` holds the action, the command and the cube; ``tasks`` the detectors' built-in tasks and thresholds."""
