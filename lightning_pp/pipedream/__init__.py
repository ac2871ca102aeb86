"""The asynchronous schedule ``schedule="pipedream_2bw"`` in one place: the never-draining 1F1B stream cut into
Lightning's steps (``stream``, pure data) and one rank's step over its cut with the weight stash (``step``).

May import: ``runtime``, ``schedule``, ``errors``."""
