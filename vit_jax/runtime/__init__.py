"""The process and its devices: host settings (`host`), what the host's CPU
is (`cpu_info`), the mesh and shardings (`sharding`), several processes
(`multihost`), stop signals (`preemption`), random keys whose draws
compile faster (`prng`)."""
