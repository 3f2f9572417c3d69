"""``python -m wsi_loader.cli``, as the ``wsi-loader`` script."""

import sys

from wsi_loader.cli.main import main

sys.exit(main())
