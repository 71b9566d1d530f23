"""`tandem router`: routing policies (torch-free), the worker pool with health and load, and
the front end, whose PD mode is `tandem proxy`."""
