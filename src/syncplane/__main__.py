import sys

from syncplane.runtime.lifetime import skip_collection_at_exit

skip_collection_at_exit()
if sys.argv[1:2] in (["bench"], ["compare"], ["soak"]):
    # these commands launch ranks: the fork server imports torch and Lightning while this
    # process imports what it needs to read the command (train.py does the same)
    from syncplane.runtime import forkserver

    forkserver.preload("syncplane.bench.worker")   # the bench's rank module (compare and soak run it too)
    forkserver.warm_up()

from syncplane.cli import main  # noqa: E402

sys.exit(main())
