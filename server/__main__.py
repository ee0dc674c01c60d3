"""`python -m server ...` is `kvserve ...`."""
from server.cli import main

raise SystemExit(main())
