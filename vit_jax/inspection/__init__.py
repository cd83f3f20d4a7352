"""Looking inside a model and a run: attention maps, shape traces and
parameter tables (`introspect`), evaluation reports (`reports`), figures
(`plots`), and the `main.py` modes built on them (`tools`)."""
