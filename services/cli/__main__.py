import sys

from motor_mesh.cli.main import main

sys.exit(main())
