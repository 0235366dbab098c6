"""FLOPs, parameters, latency, activation bytes and communication of one training step, per module
and per sub-block, under the config's plan. See docs/profiling.md; run with --help."""
from galaxy.profiler.cli import main

if __name__ == "__main__":
    main()
