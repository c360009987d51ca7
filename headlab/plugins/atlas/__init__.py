"""The head atlas (docs/atlas.md): every head of a model labelled by every detector, the causal check of the
labels and the comparison of two models."""
