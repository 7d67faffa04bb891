"""`python -m search.merge --spec RUN_DIR/merge.json`: a merge candidate's weights built in a round's process."""

import sys

from search.merge.soup import main

sys.exit(main())
