# Thin wrapper over CMake. `make` builds, `make test` builds and runs the tests
# (GPU tests skip without a Hopper GPU), `make run` runs the main job (tw-bench
# with defaults on the local GPUs, virtual ranks when there is one GPU),
# `make gpu-suite` runs every GPU test and benchmark (scripts/gpu-suite.sh).
BUILD ?= build
BUILD_TYPE ?= Release
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
GENERATOR := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)

.PHONY: all configure test run gpu-suite clean format format-check

all: configure
	cmake --build $(BUILD) -j $(JOBS)

configure:
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	TILEWIRE_LIB=$(abspath $(BUILD))/libtilewire.so python3 -m pytest python/tests -q

run: all
	$(BUILD)/tw-bench

gpu-suite: all
	TW_BUILD_DIR=$(BUILD) bash scripts/gpu-suite.sh

format:
	clang-format -i --style=file $$(git ls-files '*.c' '*.h' '*.cu' '*.cuh')

format-check:
	clang-format --dry-run --Werror --style=file $$(git ls-files '*.c' '*.h' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD)
