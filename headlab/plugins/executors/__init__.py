"""Built-in executors: ``local`` (cells one after another in this process, the default) and ``ray``
(each cell a task on a Ray cluster). Each is a plugin module implementing ``headlab_register_executors``
on public names of headlab only, as a third-party executor (Slurm, Dask, ...) would be."""
