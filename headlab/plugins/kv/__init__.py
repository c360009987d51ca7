"""Built-in KV-cache policies: ``full`` (every head keeps its whole cache), ``streaming`` (DuoAttention's
retrieval and streaming heads), ``razor`` (streaming plus RazorAttention's compensation token) and
``random`` (as many full KV heads drawn at random: the control). Each is a plugin module implementing
``headlab_register_kv_policies`` on public names of headlab only, and compiles its config into a
:class:`headlab.kv.HeadMap`."""
