"""tests/book/ checks the built website in a browser: `make book-test` (which builds it first) runs it with
HSGD_BOOK_TEST=1; `make test` leaves it out (it needs the built book and Chromium)."""
import os

collect_ignore = [] if os.environ.get("HSGD_BOOK_TEST") == "1" else ["test_site.py"]
