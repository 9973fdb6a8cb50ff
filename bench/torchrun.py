"""torchrun, as /usr/bin/torchrun runs it, with one mend: Debian's torch 1.13
under Python 3.11 reads --redirects/--tee "0" as None (Std.from_str looks
the value up by iterating an IntFlag, which no longer yields NONE or ALL),
and every launch fails with "'NoneType' object has no attribute 'get'".
The mend reads the value as Std(int(v)), as the function's own docstring
says it should; nothing else of the launcher changes.

    python3 bench/torchrun.py [torchrun's arguments]
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import api


def from_str(cls, vm):
    if re.match(api._VALUE_REGEX, vm):
        return cls(int(vm))
    if re.match(api._MAPPING_REGEX, vm):
        return {int(i): cls(int(v))
                for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{api._VALUE_REGEX}> or "
                     f"<{api._MAPPING_REGEX}>")


api.Std.from_str = classmethod(from_str)

if __name__ == "__main__":
    from torch.distributed.run import main
    sys.exit(main())
