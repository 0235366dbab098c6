"""The edge testbed: run any command on emulated unequal devices, one rank per device.

    python -m galaxy.edge run --cluster clusters/home3.json -- python pretrain_galaxy.py --config_file c.json
    python -m galaxy.edge run --shield ...                         # the same, other processes held back
    python -m galaxy.edge check --cluster clusters/home3.json     # what would be built; needs no root
    python -m galaxy.edge clean                                    # remove what a killed run left

A device is a network namespace on a private bridge with a veth link shaped both ways (tc tbf),
a CPU share (CFS quota) and a memory limit without swap (cgroup v1 or v2), and its own host name.
Modules, one job each: cluster (the cluster file), host (what the host must offer), runs (names,
subnets, state files, the lock), network and shaping (namespaces, links, qdiscs), cgroups, ranks
(starting a rank inside its device), output (prefixed output, progress bars intact), supervisor
(watching the ranks), testbed (up, run, down), shield (`run --shield`: the host's other
processes at the least CPU weight while a run lasts), clean. docs/edge.md has the figures.
"""
