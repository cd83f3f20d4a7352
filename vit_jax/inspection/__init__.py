"""Looking inside a model and a run: attention maps, shape traces and
parameter tables (`introspect`), the paper's Figure 7 (`figure7`),
evaluation reports (`reports`), figures (`plots`), and the command-line
modes built on them (`tools`)."""
