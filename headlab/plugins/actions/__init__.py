"""Built-in step actions: ``detect``, ``generate`` and ``score``.

Each is a plugin module implementing ``headlab_register_actions``, written only against public names
of headlab, exactly as a third-party action (say ``patch``) would be. :mod:`.common` holds what the
decoding actions share.
"""
