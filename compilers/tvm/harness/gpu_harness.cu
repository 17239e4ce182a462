// qnorm GPU harness: runs TVM-generated CUDA kernels from plan files, without TVM.
//
// Build: nvcc -O2 -std=c++17 compilers/tvm/harness/gpu_harness.cu -o gpu_harness
// Usage: gpu_harness PLAN...   (exit 0: every run ok; 1: a run differs; 2: a plan could not run)
//
// A plan (written by compilers/tvm/cuda.py:write_plan) is text, one directive per
// line; file names are relative to the plan's directory:
//   qnorm-gpu-plan 1
//   module STEM ARCH...               kernels built for ARCH... (sm_80 sm_90): loads
//                                     STEM.sm_XY.cubin for this GPU, else the PTX of the
//                                     newest older ARCH (the driver JIT-compiles it)
//   run LABEL                         a run: its buffers, launches and checks, up to `end`
//   buffer NAME DTYPE COUNT FILE|-    COUNT elements (int8/16/32/64, float32), from FILE or zeroed
//   launch KERNEL GX GY GZ BX BY BZ NARGS ARG...   ARG: buf:NAME | i32:V | i64:V
//   expect NAME FILE                  the buffer must equal FILE, element by element
//   crc32 NAME VALUE                  the buffer's CRC-32 (zlib's) must be VALUE
//   save NAME FILE                    write the buffer to FILE
//   time ITERS                        time 5 rounds of ITERS repetitions of the launches
//   end
// Output, one line per run:
//   ok LABEL ELEMENTS [time_us MEDIAN MIN]     (microseconds per repetition of the launches)
//   FAIL LABEL REASON
//   ERROR PLAN REASON                          (the plan stopped: bad plan, no GPU, ...)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct SetupError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw SetupError(what + ": " + cudaGetErrorString(err));
}

size_t dtype_size(const std::string& dtype) {
  if (dtype == "int8") return 1;
  if (dtype == "int16") return 2;
  if (dtype == "int32") return 4;
  if (dtype == "float32") return 4; /* a whole model's float buffers: compared bit for bit, as int32 */
  if (dtype == "int64") return 8;
  throw SetupError("unknown dtype " + dtype);
}

long long element(const std::vector<char>& bytes, size_t i, size_t size) {
  const char* p = bytes.data() + i * size;
  switch (size) {
    case 1: return *reinterpret_cast<const int8_t*>(p);
    case 2: { int16_t v; std::memcpy(&v, p, 2); return v; }
    case 4: { int32_t v; std::memcpy(&v, p, 4); return v; }
    default: { int64_t v; std::memcpy(&v, p, 8); return v; }
  }
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SetupError("cannot read " + path);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

uint32_t crc32(const std::vector<char>& bytes) {  // zlib's CRC-32 (reflected 0xEDB88320)
  uint32_t table[256];
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  uint32_t crc = 0xFFFFFFFFu;
  for (char b : bytes) crc = table[(crc ^ static_cast<uint8_t>(b)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

struct Buffer {
  std::string dtype;
  size_t count = 0;
  void* dev = nullptr;
  size_t bytes() const { return count * dtype_size(dtype); }
};

struct Launch {
  std::string kernel;
  dim3 grid, block;
  std::vector<std::string> args;
};

struct Run {
  std::string label;
  std::map<std::string, Buffer> buffers;
  std::vector<std::pair<std::string, std::string>> fills, expects, saves, crcs;
  std::vector<Launch> launches;
  int time_iters = 0;
};

class Harness {
 public:
  explicit Harness(std::string dir) : dir_(std::move(dir)) {}
  ~Harness() {
    if (library_) cudaLibraryUnload(library_);
  }

  void load(const std::string& stem, const std::vector<int>& archs) {
    std::string file = path(stem) + module_suffix(archs);
    if (library_) cudaLibraryUnload(library_);
    kernels_.clear();
    check(cudaLibraryLoadFromFile(&library_, file.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0),
          "loading " + file);
    std::fprintf(stderr, "module %s\n", file.c_str());
  }

  // Returns false if the run's outputs differ (the reason is printed).
  bool execute(Run& run) {
    for (auto& [name, buf] : run.buffers) {
      check(cudaMalloc(&buf.dev, std::max<size_t>(buf.bytes(), 1)), "cudaMalloc " + name);
      check(cudaMemset(buf.dev, 0, buf.bytes()), "cudaMemset " + name);
    }
    for (auto& [name, file] : run.fills) {
      std::vector<char> data = read_file(path(file));
      Buffer& buf = run.buffers.at(name);
      if (data.size() != buf.bytes()) throw SetupError(file + ": wrong size for buffer " + name);
      check(cudaMemcpy(buf.dev, data.data(), data.size(), cudaMemcpyHostToDevice), "copy " + name);
    }
    launch_all(run);
    check(cudaDeviceSynchronize(), "running " + run.label);
    std::string failure;
    size_t elements = 0;
    for (auto& [name, file] : run.expects) {
      std::vector<char> want = read_file(path(file)), got = fetch(run.buffers.at(name));
      size_t size = dtype_size(run.buffers.at(name).dtype);
      if (want.size() != got.size()) throw SetupError(file + ": wrong size for buffer " + name);
      elements += got.size() / size;
      for (size_t i = 0; i < got.size() / size && failure.empty(); ++i) {
        if (element(got, i, size) != element(want, i, size)) {
          failure = name + " element " + std::to_string(i) + ": expected " +
                    std::to_string(element(want, i, size)) + ", got " +
                    std::to_string(element(got, i, size));
        }
      }
    }
    for (auto& [name, value] : run.crcs) {
      std::vector<char> got = fetch(run.buffers.at(name));
      elements += got.size() / dtype_size(run.buffers.at(name).dtype);
      if (failure.empty() && std::to_string(crc32(got)) != value) {
        failure = name + " CRC-32 " + std::to_string(crc32(got)) + ", expected " + value;
      }
    }
    for (auto& [name, file] : run.saves) {
      std::vector<char> got = fetch(run.buffers.at(name));
      std::ofstream(path(file), std::ios::binary).write(got.data(), got.size());
    }
    std::string timing = failure.empty() && run.time_iters ? " " + time_launches(run) : "";
    for (auto& [name, buf] : run.buffers) cudaFree(buf.dev);
    if (!failure.empty()) {
      std::printf("FAIL %s %s\n", run.label.c_str(), failure.c_str());
      return false;
    }
    std::printf("ok %s %zu%s\n", run.label.c_str(), elements, timing.c_str());
    return true;
  }

 private:
  static std::string module_suffix(const std::vector<int>& archs) {
    int device = 0, major = 0, minor = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "capability");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "capability");
    int cc = 10 * major + minor, best = 0;
    for (int a : archs) {
      if (a == cc) return ".sm_" + std::to_string(a) + ".cubin";
      if (a < cc) best = std::max(best, a);
    }
    if (!best) throw SetupError("no kernels built for sm_" + std::to_string(cc) + " or older");
    return ".sm_" + std::to_string(best) + ".ptx";
  }

  std::string path(const std::string& file) const { return file[0] == '/' ? file : dir_ + file; }

  std::vector<char> fetch(const Buffer& buf) {
    std::vector<char> out(buf.bytes());
    check(cudaMemcpy(out.data(), buf.dev, out.size(), cudaMemcpyDeviceToHost), "copy back");
    return out;
  }

  void launch_all(Run& run) {
    for (Launch& l : run.launches) {
      if (l.grid.x * l.grid.y * l.grid.z == 0) continue;  // no rows
      std::vector<int64_t> scalars(l.args.size());
      std::vector<void*> ptrs(l.args.size());
      for (size_t i = 0; i < l.args.size(); ++i) {
        const std::string& a = l.args[i];
        if (a.rfind("buf:", 0) == 0) {
          ptrs[i] = &run.buffers.at(a.substr(4)).dev;
        } else if (a.rfind("i64:", 0) == 0 || a.rfind("i32:", 0) == 0) {
          scalars[i] = std::stoll(a.substr(4));
          ptrs[i] = &scalars[i];  // little-endian: an int32 is the low half
        } else {
          throw SetupError("bad argument " + a);
        }
      }
      check(cudaLaunchKernel(kernel(l.kernel), l.grid, l.block, ptrs.data(), 0, nullptr),
            "launching " + l.kernel);
    }
  }

  const void* kernel(const std::string& name) {
    auto it = kernels_.find(name);
    if (it == kernels_.end()) {
      cudaKernel_t k;
      check(cudaLibraryGetKernel(&k, library_, name.c_str()), "finding kernel " + name);
      it = kernels_.emplace(name, k).first;
    }
    return reinterpret_cast<const void*>(it->second);
  }

  std::string time_launches(Run& run) {
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "event");
    check(cudaEventCreate(&stop), "event");
    for (int i = 0; i < 10; ++i) launch_all(run);  // warm-up
    std::vector<float> per_rep;
    for (int round = 0; round < 5; ++round) {
      check(cudaEventRecord(start), "event");
      for (int i = 0; i < run.time_iters; ++i) launch_all(run);
      check(cudaEventRecord(stop), "event");
      check(cudaEventSynchronize(stop), "timing " + run.label);
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "event");
      per_rep.push_back(1000.0f * ms / run.time_iters);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::sort(per_rep.begin(), per_rep.end());
    char text[64];
    std::snprintf(text, sizeof text, "time_us %.3f %.3f", per_rep[per_rep.size() / 2], per_rep[0]);
    return text;
  }

  std::string dir_;
  cudaLibrary_t library_ = nullptr;
  std::map<std::string, cudaKernel_t> kernels_;
};

// Runs every run of one plan; returns false if any failed.
bool run_plan(const std::string& path) {
  std::string dir = path.substr(0, path.find_last_of('/') + 1);
  std::ifstream in(path);
  if (!in) throw SetupError("cannot read plan " + path);
  std::string line, word;
  std::getline(in, line);
  if (line != "qnorm-gpu-plan 1") throw SetupError(path + ": not a qnorm-gpu-plan 1 file");
  Harness harness(dir);
  Run run;
  bool ok = true;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    if (!(f >> word)) continue;
    if (word == "module") {
      std::vector<int> archs;
      f >> word;
      for (std::string a; f >> a;) {
        if (a.rfind("sm_", 0) != 0) throw SetupError(path + ": bad architecture " + a);
        archs.push_back(std::stoi(a.substr(3)));
      }
      if (archs.empty()) throw SetupError(path + ": module line names no architecture");
      f.clear();  // reading the architectures ran to the end of the line
      harness.load(word, archs);
    } else if (word == "run") {
      run = Run();
      f >> run.label;
    } else if (word == "buffer") {
      std::string name, dtype, file;
      size_t count;
      f >> name >> dtype >> count >> file;
      run.buffers[name] = Buffer{dtype, count};
      if (file != "-") run.fills.emplace_back(name, file);
    } else if (word == "launch") {
      Launch l;
      size_t n;
      f >> l.kernel >> l.grid.x >> l.grid.y >> l.grid.z >> l.block.x >> l.block.y >> l.block.z >> n;
      l.args.resize(n);
      for (auto& a : l.args) f >> a;
      run.launches.push_back(l);
    } else if (word == "expect" || word == "crc32" || word == "save") {
      std::string name, value;
      f >> name >> value;
      auto& list = word == "expect" ? run.expects : word == "crc32" ? run.crcs : run.saves;
      list.emplace_back(name, value);
    } else if (word == "time") {
      f >> run.time_iters;
    } else if (word == "end") {
      ok = harness.execute(run) && ok;
    } else {
      throw SetupError(path + ": unknown directive " + word);
    }
    if (f.fail()) throw SetupError(path + ": malformed line: " + line);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PLAN...\n", argv[0]);
    return 2;
  }
  int status = 0;
  for (int i = 1; i < argc; ++i) {
    try {
      if (!run_plan(argv[i])) status = std::max(status, 1);
    } catch (const std::exception& e) {  // this plan stops; the others still run
      std::printf("ERROR %s: %s\n", argv[i], e.what());
      status = 2;
    }
    std::fflush(stdout);
  }
  return status;
}
