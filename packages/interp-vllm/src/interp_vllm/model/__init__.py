"""What both sides know of a served model's structure: the families vLLM's model classes are
resolved to (:mod:`._families`, :mod:`._resolve`, on the module tree :mod:`._meta_model` builds
without weights before an engine starts) and where each address lives in them, the site table
(:mod:`._sites`).

It imports nothing of the front end, the worker or the backends built on them.
"""
