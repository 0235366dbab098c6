"""Plan search: profile the devices and the model, find the fastest plan that fits each device's memory,
write it as a train config. See docs/planning.md; run with --help."""
from galaxy.planner.cli import main

if __name__ == "__main__":
    main()
