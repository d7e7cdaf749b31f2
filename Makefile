# Thin wrapper over CMake.
#   make               configure (once) and build into $(BUILD) (default build/)
#   make run           build, then run the main job: tw-bench with its defaults on the local GPUs
#                      (virtual ranks when there is one GPU)
#   make test          build, then run every test through ctest: C tests, the Python tests
#                      (skipped, with a note, when pytest is not installed), the install test and
#                      the size check; GPU tests skip (exit 77) without a Hopper GPU
#   make gpu-suite     scripts/gpu-suite.sh: a fresh -Werror build, then every GPU test and
#                      benchmark, with a summary table (on a GPU machine)
#   make install       build, then install into $(PREFIX) (default /usr/local): the library, the
#                      header, tw-info, tw-bench, pkg-config and CMake package files
#   make format        clang-format every tracked C/CUDA file in place
#   make format-check  fail when a tracked C/CUDA file is not clang-formatted
#   make clean         delete $(BUILD)
# Variables: BUILD, BUILD_TYPE (Release), PREFIX, JOBS, CMAKE_FLAGS (passed to cmake when it
# configures; given on an already configured build they are applied to it), e.g.
#   make test CMAKE_FLAGS=-DTW_WERROR=ON
BUILD ?= build
BUILD_TYPE ?= Release
PREFIX ?= /usr/local
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
GENERATOR := $(if $(shell command -v ninja 2>/dev/null),-G Ninja,)
C_SOURCES = $$(git ls-files '*.c' '*.h' '*.cu' '*.cuh')

.PHONY: all configure test run gpu-suite install clean format format-check

all: configure
	cmake --build $(BUILD) -j $(JOBS)

configure:
	@if [ ! -f $(BUILD)/CMakeCache.txt ]; then \
	  cmake -S . -B $(BUILD) $(GENERATOR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS); \
	elif [ -n "$(strip $(CMAKE_FLAGS))" ]; then \
	  cmake $(BUILD) $(CMAKE_FLAGS); \
	fi

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@grep -h '^pytest not installed' $(BUILD)/Testing/Temporary/LastTest.log 2>/dev/null || true

run: all
	$(BUILD)/tw-bench

gpu-suite:
	bash scripts/gpu-suite.sh

install: all
	cmake --install $(BUILD) --prefix $(PREFIX)

format:
	clang-format -i --style=file $(C_SOURCES)

format-check:
	clang-format --dry-run --Werror --style=file $(C_SOURCES)

clean:
	rm -rf $(BUILD)
