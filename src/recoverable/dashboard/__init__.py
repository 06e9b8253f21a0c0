"""The operator's web dashboard (``recoverable dashboard``, docs/dashboard.md): a
Starlette app served by Hypercorn's Trio worker over one store.

Its web dependencies are the ``dashboard`` extra (``pip install 'recoverable[dashboard]'``);
only ``app``, ``security`` and ``server`` import them, so the CLI's bulk actions, which share
``data`` and ``actions`` with the console, work without it. Modules: ``server`` (the
command), ``app`` (routes), ``data`` (the summary, pages and the operation view, read
through the store contract only), ``pages``, ``console``, ``explain``, ``fleet``,
``glossary`` and ``html`` (HTML), ``actions`` (the per-operation rules and actions),
``security`` (token, sessions, origin and host checks).
"""
