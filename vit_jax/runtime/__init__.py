"""The process and its devices: host settings (`host`), the mesh and
shardings (`sharding`), several processes (`multihost`), stop signals
(`preemption`)."""
