"""``python -m radixserve ...`` is the same as the ``radixserve`` command."""

from radixserve.cli import main

raise SystemExit(main())
