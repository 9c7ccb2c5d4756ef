"""Summarise an ncu source page (CSV, SASS) after the first cluster barrier (the wgmma split-K epilogue):
    ncu --import REP --page source --csv --print-source sass > src.csv && python3 docs/probes/ncu_source_summary.py src.csv"""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next(i for i, r in enumerate(rows) if any("Address" in c for c in r))
hdr = rows[hdr_i]
print("columns:", [h for h in hdr][:40])
data = rows[hdr_i + 1:]
ci = {h: i for i, h in enumerate(hdr)}
src = next(h for h in hdr if h.strip() in ("Source",))
samp = next(h for h in hdr if "Warp Stall Sampling (All" in h)
def num(x):
    try: return float(x.replace(",", ""))
    except Exception: return 0.0
start = next((i for i, r in enumerate(data) if "UCGABAR" in r[ci[src]]), None)
tot = sum(num(r[ci[samp]]) for r in data)
print("total samples", tot, "epilogue starts at row", start)
if start is None: sys.exit()
epi = data[start:]
print("epilogue samples", sum(num(r[ci[samp]]) for r in epi))
reasons = [h for h in hdr if h.startswith("stall_") or "Stall" in h and "Sampling" not in h]
agg = collections.Counter()
for r in epi:
    for h in hdr:
        if "smsp__pcsamp_warps_issue_stalled" in h or h.startswith("stall"):
            agg[h] += num(r[ci[h]])
for h, v in agg.most_common(12): print(f"  {h}: {v:.0f}")
top = sorted(epi, key=lambda r: -num(r[ci[samp]]))[:25]
for r in top: print(f"{num(r[ci[samp]]):8.0f}  {r[ci[hdr[0]]]}  {r[ci[src]][:90]}")
