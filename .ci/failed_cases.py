"""Print the pytest node ids of the failed or errored cases of a JUnit XML report, one line."""

import sys
import xml.etree.ElementTree as ET

ids = []
for case in ET.parse(sys.argv[1]).iter("testcase"):
    if case.find("failure") is not None or case.find("error") is not None:
        path = case.get("classname", "").replace(".", "/") + ".py"
        ids.append(f"{path}::{case.get('name')}")
print(" ".join(dict.fromkeys(ids)))
