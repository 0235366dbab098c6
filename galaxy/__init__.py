"""Galaxy: hybrid tensor/sequence/data/pipeline parallel training of transformer models."""
