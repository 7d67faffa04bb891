"""`python -m search.promotion`: the answers check's own process (search.promotion.verification)."""

from common.process_exit import exit_now
from search.promotion.verification import serve

exit_now(serve())
