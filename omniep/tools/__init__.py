"""What the ``omniep`` command runs: ``info``, ``demo`` and ``bench``."""
