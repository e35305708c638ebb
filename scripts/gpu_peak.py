"""Write the GPU's peak used memory in MiB (NVML, device 0, sampled every 20 ms) to a file when killed.

Used by scripts/h200.sh to read another program's peak (llama.cpp's), which reports none itself:
``python3 scripts/gpu_peak.py OUT_FILE &`` then ``kill`` it (SIGTERM); the file then holds the peak.
"""

import signal
import sys
import time

import pynvml


def main(path: str) -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    base = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    peak = 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        peak = max(peak, pynvml.nvmlDeviceGetMemoryInfo(handle).used - base)
        time.sleep(0.02)
    with open(path, "w") as f:  # once, at the end: no file write in the sampling loop
        f.write(f"{peak / 2**20:,.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
