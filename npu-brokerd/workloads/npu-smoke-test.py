"""The npu.smoke_test workload: one tiny MindSpore addition on the Ascend device.

Prints JSON with sorted keys: {"device_target", "ok": true, "result"} (internals 4.7).
"""
import json
import sys

import mindspore as ms
import numpy as np

ms.set_context(device_target="Ascend")
a = ms.Tensor(np.array([1, 2, 3], dtype=np.float32))
b = ms.Tensor(np.array([3, 2, 1], dtype=np.float32))
result = (a + b).asnumpy().tolist()
print(json.dumps({"device_target": "Ascend", "ok": True, "result": result}, sort_keys=True))
sys.exit(0)
