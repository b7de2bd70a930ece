"""The contract between the builder, the server, the clients and the deployment: no torch, no Triton.

- `protocol`: the front models' tensor names and types, the statistics each response carries (derived
  here, once), the stop-string rule, the required inputs and value ranges, and the error classes
  (with the words that carry them to a client).
- `layout`: the build layout, the manifest reader and the build key.
- `server`: ports, probe paths, the health watch and the drain protocol of `dflash-serve`.
- `presets`: the targets we know, their drafters and their defaults.

Everything here is plain Python, so a backend service (`clients/`), the gateway and the Helm chart's
contract generator (`deploy/helm/contract.py`) import it without the model stack.
"""


class DFlashError(ValueError):
    """A user error: bad input, missing files, invalid checkpoints. CLIs print it without a traceback."""
