"""Putting a model to work: one rank's part of a model under a plan and a pipeline stage
(assemble.build_model), the runner that trains it on any mesh (runners.build_runner), greedy
generation and Hugging Face export of what any plan trained."""
