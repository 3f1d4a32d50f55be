"""The composition root: the ``pipeline`` command. It reads the settings once, builds each
service from them, and runs it (``services``); it also starts the local stack
(``local``), the demo (``demo``) and the benchmarks. Nothing imports it."""
